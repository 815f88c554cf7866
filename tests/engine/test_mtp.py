"""MTP drafts (`speculative_config={"method": "mtp"}`, spec_decode/mtp.py) on a tiny random
DeepSeek-V3 whose checkpoint carries one multi-token prediction layer after its decoder's.

The oracle of the drafts is the MTP module recomputed from scratch in torch: transformers'
DeepSeek-V3 target gives the hidden states (after its final norm), its decoder layer class
runs the MTP layer's weights over the pairs (h_p, t_{p+1}) at positions p, and the greedy
drafts chain through the layer's own outputs (vLLM's DeepSeekMTP). Every greedy proposal
the engine makes, after whatever steps came before (chunked prefill, prefix hits with the
last block dropped, preemption and recompute, TP = 2), equals the oracle's for the tokens
the request knew. The outputs equal the engine's without speculation, greedy and sampled."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from deepseek_oracle import TINY, save_tiny
from oracle import SMALL, prompt_ids, spec_counts, with_metrics
from oracle import same_outputs as same
from safetensors.numpy import load_file, save_file

from jllm import LLM, SamplingParams
from jllm.runner.compile_guard import count_compiles

L = TINY["num_hidden_layers"]  # the MTP layer's index in the checkpoint
K = 3
PROMPTS = prompt_ids(3, 7, seed=5, vocab=512) + prompt_ids(1, 37, seed=6, vocab=512)
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=1.0, seed=3, max_tokens=11, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
]
SETTINGS = [
    {},
    {"max_num_batched_tokens": 16},  # chunked prefill: a chunk's successor from the prompt
    {"num_gpu_blocks_override": 9},  # preemption
    {"tensor_parallel_size": 2, "enable_expert_parallel": True},
]
IDS = ["plain", "chunked", "preempting", "tp2-ep"]


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory, tokenizer_dir) -> str:
    """The tiny V3 (q LoRA) with an MTP layer: a sparse decoder layer (layer 2's tensors,
    perturbed), enorm, hnorm, eh_proj, its shared head's norm and projection (random) and
    its own copy of the embedding."""
    path = tmp_path_factory.mktemp("mtp") / "v3"
    save_tiny("v3-q-lora", path, tokenizer_dir)
    tensors = load_file(path / "model.safetensors")
    rng = np.random.default_rng(0)
    D, V = TINY["hidden_size"], TINY["vocab_size"]
    mtp = f"model.layers.{L}."
    for name, w in list(tensors.items()):
        if name.startswith(f"model.layers.{L - 1}."):
            noise = 1 + 0.1 * rng.standard_normal(w.shape) if w.ndim > 1 else 1.0
            tensors[name.replace(f"layers.{L - 1}.", f"layers.{L}.")] = (w * noise).astype(
                np.float32
            )
    tensors |= {
        mtp + "enorm.weight": rng.uniform(0.5, 1.5, D).astype(np.float32),
        mtp + "hnorm.weight": rng.uniform(0.5, 1.5, D).astype(np.float32),
        mtp + "eh_proj.weight": (rng.standard_normal((D, 2 * D)) * 0.15).astype(np.float32),
        mtp + "shared_head.norm.weight": rng.uniform(0.5, 1.5, D).astype(np.float32),
        mtp + "shared_head.head.weight": (rng.standard_normal((V, D)) * 0.25).astype(np.float32),
        mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].copy(),
    }
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return str(path)


class MtpOracle:
    """The MTP module in torch, from scratch for every proposal (float32)."""

    def __init__(self, path: str):
        self.target = transformers.AutoModelForCausalLM.from_pretrained(
            path, attn_implementation="eager"
        ).eval()
        config = self.target.config
        tensors = {
            k: torch.from_numpy(v) for k, v in load_file(f"{path}/model.safetensors").items()
        }
        prefix = f"model.layers.{L}."
        own = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        self.layer = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer(
            config, L
        ).eval()
        weights = {
            k: v for k, v in own.items() if k.startswith(("self_attn.", "mlp.", "input_", "post_"))
        }
        E = config.n_routed_experts
        expert = [
            {p: weights.pop(f"mlp.experts.{e}.{p}_proj.weight") for p in ("gate", "up", "down")}
            for e in range(E)
        ]
        fused = self.layer.state_dict()
        if "mlp.experts.gate_up_proj" in fused:  # transformers' fused experts in memory
            weights["mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([x["gate"], x["up"]]) for x in expert]
            )
            weights["mlp.experts.down_proj"] = torch.stack([x["down"] for x in expert])
            for name in ("gate_up_proj", "down_proj"):
                assert weights[f"mlp.experts.{name}"].shape == fused[f"mlp.experts.{name}"].shape
        else:
            for e, x in enumerate(expert):
                weights |= {f"mlp.experts.{e}.{p}_proj.weight": w for p, w in x.items()}
        self.layer.load_state_dict(weights)
        self.embed, self.head = own["embed_tokens.weight"], own["shared_head.head.weight"]
        self.eh_proj = own["eh_proj.weight"]
        norm = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RMSNorm
        self.norms = {}
        for name in ("enorm", "hnorm", "shared_head.norm"):
            self.norms[name] = norm(config.hidden_size, config.rms_norm_eps)
            self.norms[name].weight.data = own[f"{name}.weight"]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The greedy drafts after `tokens` (t_0 .. t_{L-1})."""
        ids = torch.tensor([tokens[:-1]])
        hidden = self.target.model(ids).last_hidden_state[0]  # h_0 .. h_{L-2}, after the norm
        nxt, prev, out = list(tokens[1:]), list(hidden), []
        for _ in range(k):
            M = len(nxt)
            e = self.embed[torch.tensor(nxt)].clone()
            e[0] = 0.0  # position 0's embedding, as vLLM's
            h = torch.stack(prev)
            x = torch.cat([self.norms["enorm"](e), self.norms["hnorm"](h)], -1) @ self.eh_proj.T
            pos = torch.arange(M)[None]
            rope = self.target.model.rotary_emb(x[None], pos)
            mask = torch.full((M, M), float("-inf")).triu(1)[None, None]
            y = self.layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=rope)
            y = (y[0] if isinstance(y, tuple) else y)[0]  # [M, D]
            draft = int((self.norms["shared_head.norm"](y[-1]) @ self.head.T).argmax())
            out.append(draft)
            nxt.append(draft)
            prev.append(y[-1])
        return out


def recording(llm):
    """Wraps the engine's MTP proposer: every greedy request's (known tokens, drafts)."""
    runner = llm.llm_engine.runner
    draft, calls = runner.draft, []
    propose = draft.propose

    def wrapped(runner_, groups, sampled=None):
        out = propose(runner_, groups, sampled)
        batch = runner_.batch
        for g in groups:
            row = g.row
            if g.req_id in out and batch.temperature[row] == 0.0:
                known = batch.token_ids[row, : batch.num_tokens[row]].tolist()
                calls.append((known, out[g.req_id]))
        return out

    draft.propose = wrapped
    return calls


def run(llm, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def expected(mtp_checkpoint):
    return run(LLM(mtp_checkpoint, **{**SMALL, "dtype": "float32"}))


@pytest.fixture(scope="module")
def oracle(mtp_checkpoint):
    return MtpOracle(mtp_checkpoint)


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_mtp_drafts_equal_the_oracle_and_outputs_are_exact(
    mtp_checkpoint, expected, oracle, settings
):
    spec = {"method": "mtp", "num_speculative_tokens": K}
    llm = LLM(
        mtp_checkpoint, **{**SMALL, "dtype": "float32", "speculative_config": spec, **settings}
    )
    prom = with_metrics(llm)
    calls = recording(llm)
    same(run(llm), expected)
    drafts, drafted, accepted = spec_counts(prom)
    assert drafts > 10 and drafted >= drafts and 0 <= accepted <= drafted
    assert len(calls) > 10
    for known, got in calls:
        assert got == oracle.drafts(known, len(got)), len(known)
    if settings.get("num_gpu_blocks_override"):
        assert llm.llm_engine.scheduler.num_preemptions > 0
    if not settings:  # again from the prefix cache, the last block of each hit dropped
        kv = llm.llm_engine.scheduler.kv_cache
        hits, before = kv.prefix_hits, len(calls)
        same(run(llm), expected)
        assert kv.prefix_hits > hits
        for known, got in calls[before:]:
            assert got == oracle.drafts(known, len(got))


def test_mtp_is_refused_where_it_cannot_run(llama_dir, mtp_checkpoint, tmp_path):
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="jllm has them for DeepSeek-V3 checkpoints"):
        LLM(llama_dir, **{**SMALL, "speculative_config": spec})
    with pytest.raises(ValueError, match="from the target's own checkpoint"):
        LLM(mtp_checkpoint, **{**SMALL, "speculative_config": {**spec, "model": llama_dir}})
    config = json.loads(open(f"{mtp_checkpoint}/config.json").read())
    folder = tmp_path / "no-mtp"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="num_nextn_predict_layers >= 1"):
        LLM(str(folder), load_format="dummy", skip_tokenizer_init=True, speculative_config=spec)
    # vLLM's former name is the same method
    llm = LLM(
        mtp_checkpoint,
        **{**SMALL, "dtype": "float32"},
        speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 1},
    )
    assert llm.llm_engine.runner.draft.k == 1


def test_no_compile_after_warmup_with_mtp(mtp_checkpoint):
    """Every MTP draft step's bucket is compiled at start-up, beside the forward's."""
    llm = LLM(
        mtp_checkpoint,
        dtype="float32",
        kv_cache_memory_bytes=16 << 20,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        disable_log_stats=True,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
    )
    prom = with_metrics(llm)
    with count_compiles() as events:
        run(llm, PROMPTS)
    assert events == []
    assert spec_counts(prom)[0] > 0


def test_mtp_crosses_shared_prefixes_and_several_samples(mtp_checkpoint, oracle):
    """Two requests with one 20-token prefix admitted in the same step (the second's hit
    waits for the first's writes, the drafts' successors read from either), and a request
    of n = 2 (its samples fork the prompt's blocks): the engine's outputs without
    speculation, and every greedy draft the oracle's."""
    spec = {"method": "mtp", "num_speculative_tokens": K}
    shared = prompt_ids(1, 20, seed=9, vocab=512)[0]
    prompts = [shared + [5, 6, 7], shared + [8, 9], prompt_ids(1, 9, seed=10, vocab=512)[0]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1),
        SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=9, ignore_eos=True),
    ]
    requests = [{"prompt_token_ids": p} for p in prompts]

    def outputs(llm):
        return [c for o in llm.generate(requests, params, use_tqdm=False) for c in o.outputs]

    want = outputs(LLM(mtp_checkpoint, **{**SMALL, "dtype": "float32"}))
    llm = LLM(mtp_checkpoint, **{**SMALL, "dtype": "float32", "speculative_config": spec})
    calls = recording(llm)
    got = outputs(llm)
    same(got, want)
    assert len(got) == 4 and got[2].token_ids != got[3].token_ids
    assert len(calls) > 4
    for known, drafts in calls:
        assert drafts == oracle.drafts(known, len(drafts)), len(known)
