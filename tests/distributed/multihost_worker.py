"""One process of a two-process engine on 127.0.0.1 (run by test_multihost.py).

    python multihost_worker.py RANK MODEL PORT MODE PROMPTS_JSON

Each process has 2 fake CPU devices; TP = 4 spans both (a MODE ending in "-pp": PP = 2 x
TP = 2, one pipeline stage per process). Process 0 prints the greedy token ids (n = 2:
both children's) as a `TOKENS <json>` line. MODE "generate": addresses given. MODE "slurm":
no addresses, the cluster comes from (emulated) Slurm variables. MODE "lora": with LoRA, the
even prompts with the PEFT adapter at $JLLM_TEST_ADAPTER (slot writes reach process 1 in the
step messages). A MODE ending in "+crash" (before "-pp"): after TOKENS, process 0 prints
READY, waits for a line on stdin (the test kills process 1 meanwhile), then tries to
generate again and prints LOST <error>.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

from jllm import LLM, SamplingParams  # noqa: E402
from jllm.distributed import ProcessLostError  # noqa: E402

rank, model, port, mode, prompts = (
    int(sys.argv[1]),
    sys.argv[2],
    int(sys.argv[3]),
    sys.argv[4],
    json.loads(sys.argv[5]),
)
parallel = dict(tensor_parallel_size=4)
if mode.endswith("-pp"):
    mode = mode.removesuffix("-pp")
    parallel = dict(tensor_parallel_size=2, pipeline_parallel_size=2)
crash = mode.endswith("+crash")
mode = mode.removesuffix("+crash")
cluster = dict(nnodes=2, node_rank=rank, master_addr="127.0.0.1", master_port=port)
if mode == "slurm":
    # No addresses given: JAX detects the cluster from (emulated) Slurm variables, as it
    # does from the TPU metadata on Cloud TPU.
    os.environ.update(
        SLURM_JOB_ID="1",
        SLURM_STEP_NODELIST="localhost",
        SLURM_NTASKS="2",
        SLURM_PROCID=str(rank),
        SLURM_LOCALID="0",
        JAX_COORDINATOR_PORT=str(port),
    )
    cluster = dict(nnodes=2, master_port=port)
lora = {}
if mode == "lora":
    lora = dict(enable_lora=True, max_loras=1, max_lora_rank=8)
llm = LLM(
    model,
    **parallel,
    **cluster,
    **lora,
    kv_cache_memory_bytes=8 << 20,
    max_num_seqs=8,
    max_num_batched_tokens=128,
    enforce_eager=True,
    disable_log_stats=True,
)
if rank == 0:
    mesh = llm.llm_engine.runner.mesh  # (data, stage, model): each stage's processes
    stages = [
        sorted({d.process_index for d in mesh.devices[0, s].flat})
        for s in range(mesh.shape["stage"])
    ]
    print("STAGES " + json.dumps(stages), flush=True)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=10, ignore_eos=True)
    adapters = None
    if mode == "lora":
        from jllm.lora.request import LoRARequest

        adapter = LoRARequest("a", 1, os.environ["JLLM_TEST_ADAPTER"])
        adapters = [adapter if i % 2 == 0 else None for i in range(len(prompts))]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=adapters
    )
    print("TOKENS " + json.dumps([[c.token_ids for c in o.outputs] for o in outs]), flush=True)
    if crash:
        print("READY", flush=True)
        sys.stdin.readline()
        try:
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        except ProcessLostError as e:
            print(f"LOST {e}", flush=True)
            os._exit(3)
        os._exit(0)
