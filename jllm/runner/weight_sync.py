"""The runner's side of RL weight updates and sleep: what happens to its device arrays.

`WeightSync` runs vLLM's update session on the model runner: `start`, any number of
`update(weights)` (chunks; model_loader/update.py converts and checks each tensor as it
arrives), then `finish`, which builds every new parameter and installs them all at once
between two steps, so the engine serves either the old weights or the new ones, never a
mix. A bad chunk ends the session with nothing changed. The parameters keep their shapes,
dtypes and shardings, so the compiled steps run on as they are: an update compiles nothing
of the model (its scatter into a stacked parameter compiles once per shape).

Sleep (`sleep(level)`, `wake_up(tags)`): level 1 copies the parameters to host memory and
deletes their device arrays and the KV cache's; level 2 deletes both (the next update or a
wake from zeros provides the weights). Waking puts them back on their shardings; the
executables were never dropped, so waking compiles nothing either.

A speculative draft model's weights (a separate model, or DeepSeek's MTP layers) sleep
with the target's: copied to host memory and deleted at both levels. At level 2 the draft
keeps its host copy, unlike the target's weights: an update reaches the target alone, so a
discarded draft could never be given weights again.

Arrays a native update adopted without a copy are borrowed: they stay the trainer's, so a
sleep drops the engine's references to them instead of deleting them, and a later update
copies them before writing rows in place (update.py donates what it writes into).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jllm.model_loader.update import UpdateTarget, WeightUpdate
from jllm.models.packing import repacked, unpacked
from jllm.runner.kv_cache import allocate_kv_caches

logger = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")


class WeightSync:
    def __init__(self, runner, target, kv_specs, attach, sleep_mode: bool = False) -> None:
        """`target()`: what updates map onto (an UpdateTarget, built on the first update;
        it raises where the engine takes none); `kv_specs`: the abstract KV caches (each
        model's, what waking reallocates) and `attach(caches)` gives them to the runner;
        `sleep_mode` (enable_sleep_mode) allows sleep levels 1 and 2."""
        self.runner = runner
        self._target_factory = target
        self._target: UpdateTarget | None = None
        self.kv_specs = kv_specs
        self.attach = attach
        self.sleep_mode = sleep_mode
        self.session: WeightUpdate | None = None
        self.asleep: set[str] = set()  # the tags whose memory is released
        self.host_weights: dict | None = None  # level 1: path -> (host copy, sharding)
        self.borrowed: set = set()  # paths whose arrays a native update adopted as given
        self.host_draft: tuple | None = None  # asleep: (treedef, [(host copy, sharding)])

    @property
    def target(self) -> UpdateTarget:
        if self._target is None:
            self._target = self._target_factory()
        return self._target

    # ---- updates ---------------------------------------------------------------------------
    def _variables(self) -> dict:
        """The model's parameters (not its LoRA slots nor KV-cache scales): path -> Variable."""
        params = self.target.target.flat
        return {p: v for p, v in nnx.to_flat_state(self.runner.state) if p in params}

    def _declared(self, path, value):
        """A parameter's value as the model declares it: a packed projection
        (models/packing.py) unpacked."""
        layout = self.runner.packed_weights.get(path)
        return value if layout is None else unpacked(value, layout)

    def _held(self, path, value):
        """A declared value as the runner holds it: packed again where it was."""
        layout = self.runner.packed_weights.get(path)
        return value if layout is None else repacked(value, layout)

    def start(self) -> None:
        self.target  # noqa: B018 - refuses an engine that takes no updates
        if self.session is not None:
            raise RuntimeError(
                "start_weight_update called while a weight update is already active. "
                "Call finish_weight_update first."
            )
        self.session = WeightUpdate(self.target)

    def update(self, weights, native: bool = False) -> None:
        if self.session is None:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            if native:
                current = {
                    p: self._declared(p, v.get_value()) for p, v in self._variables().items()
                }
                self.session.add_native(weights, current)
            else:
                self.session.add(weights)
        except BaseException:
            self.session = None  # as vLLM: a failed chunk ends the session
            raise

    def finish(self) -> int:
        """Install the session's weights; returns how many tensors it took."""
        session, self.session = self.session, None
        if session is None:
            raise RuntimeError(
                "finish_weight_update called without a matching start_weight_update."
            )
        if "weights" in self.asleep:  # back on the devices first (level 2: zeros), then written
            self._wake_weights(zeros=self.host_weights is None)
        variables = self._variables()
        current = {p: self._declared(p, variables[p].get_value()) for p in session.paths()}
        built = session.build(current, frozenset(self.borrowed))
        new = {p: self._held(p, value) for p, value in built.items()}
        for path, value in new.items():
            variables[path].set_value(value)
        given = {id(a) for a in jax.tree.leaves(session.native)}
        self.borrowed -= set(new)
        self.borrowed |= {
            p for p, value in new.items() if any(id(a) in given for a in jax.tree.leaves(value))
        }
        return session.count

    def get_weights(self):
        """The model's parameters as the engine holds them: an `nnx.State` of
        `jax.Array`s on their shardings (stacked layers, split fused tensors)."""
        values = {p: self._declared(p, v.get_value()) for p, v in self._variables().items()}
        return nnx.from_flat_state(values)

    # ---- sleep -----------------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        if not self.sleep_mode:
            raise ValueError(
                f"Sleep level {level} needs sleep mode: start the engine with "
                "enable_sleep_mode=True (level 0 pauses scheduling without it)."
            )
        if level < 1:
            return
        if "weights" in self.asleep:  # asleep already: a partial wake_up may have
            self._delete_kv_cache()  # brought the KV cache back, which goes again
            self.asleep = set(TAGS)
            return
        variables = self._variables()
        if level == 1:
            self.host_weights = {
                p: jax.tree.map(lambda a: (np.asarray(a), a.sharding), v.get_value())
                for p, v in variables.items()
            }
        for path, v in variables.items():
            if path in self.borrowed:  # the trainer's: only the engine's references go
                v.set_value(jax.tree.map(_placeholder, v.get_value()))
                continue
            for a in jax.tree.leaves(v.get_value()):
                a.delete()
        self.borrowed.clear()  # waking (or the next update) puts the engine's own back
        self._sleep_draft()
        self._delete_kv_cache()
        self.asleep = set(TAGS)
        kept = "copied to host memory" if level == 1 else "discarded"
        logger.info("Sleep level %d: weights %s, KV cache released.", level, kept)

    def _sleep_draft(self) -> None:
        draft = getattr(self.runner, "draft", None)
        if draft is None:
            return
        leaves, treedef = jax.tree.flatten(draft.state)
        self.host_draft = treedef, [(np.asarray(a), a.sharding) for a in leaves]
        for a in leaves:
            a.delete()

    def _wake_draft(self) -> None:
        if self.host_draft is None:
            return
        treedef, pairs = self.host_draft
        self.runner.draft.state = jax.tree.unflatten(
            treedef, [jax.device_put(h, s) for h, s in pairs]
        )
        self.host_draft = None

    def _delete_kv_cache(self) -> None:
        if "kv_cache" in self.asleep:
            return
        jax.block_until_ready((self.runner._caches(), self.runner.last_tokens))
        for a in jax.tree.leaves(self.runner._caches()):
            a.delete()
        self.asleep.add("kv_cache")

    def release_kv_cache(self) -> None:
        """Free the KV cache alone (vLLM's `release_kv_cache_memory`)."""
        if "weights" in self.asleep:
            raise RuntimeError(
                "release_kv_cache_memory() requires all executor memory to be resident"
            )
        self._delete_kv_cache()

    def wake_up(self, tags) -> None:
        tags = TAGS if tags is None else tags
        if "weights" in tags and "weights" in self.asleep:
            self._wake_weights(zeros=self.host_weights is None)
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            self.attach(allocate_kv_caches(self.kv_specs))
            self.asleep.discard("kv_cache")

    def _wake_weights(self, zeros: bool = False) -> None:
        variables = self._variables()
        for path, var in variables.items():
            if zeros:  # level 2: the shapes and shardings the parameters had
                value = jax.tree.map(
                    lambda a: jax.jit(
                        lambda: jnp.zeros(a.shape, a.dtype), out_shardings=a.sharding
                    )(),
                    var.get_value(),
                )
            else:
                value = jax.tree.map(
                    lambda pair: jax.device_put(*pair),
                    self.host_weights[path],
                    is_leaf=lambda x: isinstance(x, tuple),
                )
            var.set_value(value)
        self._wake_draft()
        self.host_weights = None
        self.asleep.discard("weights")

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)


def _placeholder(a: jax.Array) -> jax.ShapeDtypeStruct:
    """What a sleeping parameter keeps of a borrowed array: its shape, dtype and sharding
    (what waking from zeros and an update's checks read)."""
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
