"""Run by tests/test_device_experts.py in a process with TRITON_INTERPRET=1 (Triton decides at
import whether its kernels are compiled or interpreted): the fused kernel on CPU tensors against
experts/grouped.py's torch path, and the runner taking it. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1"

from moefit.experts import grouped  # noqa: E402
from moefit.kernels import device_experts  # noqa: E402
from moefit.pack.quant import quantize  # noqa: E402


def kernel_errors() -> dict:
    """Relative max error of the fused kernel against the torch path: int4 (groups of 32 and
    64), Q8_0, int8; 1 to 9 token rows (more than one program's 4); one input for every expert
    or one each; rows not a multiple of the block."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for quant, group in (("int4", 32), ("int4", 64), ("q8_0", 32), ("int8", 0)):
        m, rows, cols = 3, 40, 128
        made = [quantize(torch.randn(rows, cols, generator=gen), quant, group) for _ in range(m)]
        parts = {"w": torch.stack([a for a, _ in made]), "w.scale": torch.stack([b for _, b in made])}
        worst = 0.0
        for tokens in (1, 3, 9):
            for x in (torch.randn(tokens, cols, generator=gen), torch.randn(m, tokens, cols, generator=gen)):
                assert device_experts.usable(x, quant, parts, "w")
                fused = device_experts.matvec(x, parts, "w", quant)
                ref = grouped._batched_linear(x, parts, "w", quant).float()
                worst = max(worst, float((fused - ref).abs().max() / ref.abs().max()))
        out[f"{quant}/{group}"] = worst
    return out


def runner_sums(pack: str, card: str) -> dict:
    """A decode step's resident experts through the fused kernel, the torch path and the host call."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    from moefit import kernels
    from moefit.config import ServeConfig
    from moefit.experts.groups import Groups
    from moefit.runtime.engine import Engine

    class CountOps(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountOps.ops += 1
            return func(*args, **(kwargs or {}))

    engine = Engine.open(pack, ServeConfig(device=f"sim:{card}", ctx=64, vram_reserve_mib=1, low_headroom_mib=0,
                                           min_expert_slots=0, expert_cache="16"))
    runner, m = engine.runner, engine.pack.model
    runner.group = 8
    layer = m.moe_layers[0]
    experts = list(range(m.num_experts))
    for key in [k for k in runner.slots if k[0] != layer]:
        runner.unload(key)
    for e in experts:
        if (layer, e) not in runner.slots:
            runner.load((layer, e))
    x = torch.randn(1, m.hidden_size, generator=torch.Generator().manual_seed(1))
    groups = Groups.of(torch.tensor([experts]), torch.rand(1, len(experts)))
    host = runner._host_experts(layer, x, groups)
    for e in experts:                                           # a slot's views: made once a placement, not a call
        dict(runner.slots[(layer, e)])
    kernels.usable = lambda x, quant: False                    # the device path: no host kernel
    fused_matvec = device_experts.matvec

    def one_launch(*args):
        """The interpreter's own tensor traffic is not what a GPU launches: count the kernel
        and its output's allocation, as CUDA would issue them."""
        with _disable_current_modes():
            y = fused_matvec(*args)
        CountOps.ops += 2
        return y
    device_experts.matvec = one_launch
    with CountOps():
        fused = runner._device_experts(layer, x, groups)
    fused_ops, CountOps.ops = CountOps.ops, 0
    usable, device_experts.usable = device_experts.usable, lambda *args: False     # the torch path
    with CountOps():
        plain = runner._device_experts(layer, x, groups)
    device_experts.usable, device_experts.matvec = usable, fused_matvec
    return {"fused_vs_torch": float((fused - plain).abs().max() / plain.abs().max()),
            "fused_vs_host": float((fused - host).norm() / host.norm()),
            "ops_fused": fused_ops, "ops_torch": CountOps.ops}


def falls_back() -> dict:
    """A kernel that does not compile (a Triton too old or too new) turns itself off, with the
    reason, and the torch path gives the sum."""
    import warnings
    module = device_experts._kernel()
    made = [quantize(torch.randn(40, 64), "int4", 32) for _ in range(2)]
    parts = {"gate_up": torch.stack([a for a, _ in made]), "gate_up.scale": torch.stack([b for _, b in made])}
    x = torch.randn(1, 64)
    launch = module.launch

    def fails(*args):
        raise RuntimeError("CompilationError: an unsupported construct")
    module.launch = fails
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = grouped._sliced_linear(x, parts, "gate_up", "int4", 1 << 62)
    finally:
        module.launch = launch
    return {"same_as_torch": bool(torch.equal(y, grouped._batched_linear(x, parts, "gate_up", "int4"))),
            "broken": device_experts.broken, "warned": len(caught),
            "usable_after": device_experts.usable(x, "int4", parts, "gate_up")}


if __name__ == "__main__":
    result = {"kernel": kernel_errors()}
    if len(sys.argv) == 3:
        result["runner"] = runner_sums(sys.argv[1], sys.argv[2])
    result["fallback"] = falls_back()                          # last: it turns the kernel off
    print(json.dumps(result))
