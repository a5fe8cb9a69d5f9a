"""The MoE layer's native call (moe.c run_layer): every expert a layer computes on the host in one
call, posted to the kernel pool (posted.h) so that the caller can go on while a worker leads it;
`NativeCall.result()` joins it. The runner posts a layer's call, then does that layer's
bookkeeping (the profile, the cache's counts, the next layer's prefetch) and only then waits
(experts/host_side.py): on a GPU's engine thread that bookkeeping no longer comes before the
host's experts on every layer. A decode step's call is posted straight from the router's output
(`step_post`: the kernel sorts the experts and reads their addresses from the layer's row,
experts/host_table.py), and a shared expert's SwiGLU can be posted the same way (`swiglu_post`).

One call is in flight at a time: posting another first joins it (here, keeping its result), and
any other pooled native call of the engine thread first finishes it (posted.h). What it reads (the hidden rows, the routing, the
pointer arrays) and writes (the output) is held by the NativeCall until it is joined, and the
module holds the call posted last until the next is posted: a caller that raised before waiting
frees nothing the pool still reads.
"""

from __future__ import annotations

from array import array
import ctypes
from dataclasses import dataclass

import torch

from moefit.kernels import _p, code, group_of, library
from moefit.kernels.rows import _host_rows, router_rows
from moefit.pack.layout import matrix_quants

PARTS = ("gate_up", "gate_up.scale", "down", "down.scale")
STEP_MOST = 64                                  # posted.h's: the most experts a step_post takes


def addresses(parts: dict, panels: bool = False) -> list[int]:
    """An expert's four part addresses, as moe_post takes them (0: a scale kept inside the blocks),
    and 1 where it is int4 held in panels (experts/host_panels.py), else 0. Parts that know their
    addresses without views (pack/quant.py LazyViews: a slot of a host-memory card) give them."""
    at = getattr(parts, "address", None) or (lambda name: parts[name].data_ptr())
    return [at(name) if name in parts else 0 for name in PARTS] + [int(panels)]


@dataclass(frozen=True)
class GptOssAct:
    """gpt-oss's expert activation for moe_post: the clamped, alpha-scaled gate, and each
    expert's biases (addresses of fp32 rows: gate_up [2I] gate then up, down [E])."""
    alpha: float
    limit: float
    gate_up_bias: list[int]
    down_bias: list[int]


class _StepActSpec(ctypes.Structure):
    _fields_ = [("alpha", ctypes.c_float), ("limit", ctypes.c_float), ("gu_bias", ctypes.c_void_p),
                ("dn_bias", ctypes.c_void_p), ("gu_stride", ctypes.c_int64), ("dn_stride", ctypes.c_int64)]


class StepAct:
    """gpt-oss's expert activation for a layer's step calls (step_post, route_post: posted.h's
    step_act): the clamped gate, and the layer's bias tables, fp32 host rows gate_up [N, 2I] (gate
    then up) and down [N, E], from which the kernel reads each chosen expert's rows as it reads its
    parts from the layer's row of addresses. `of(experts)` gives moe_post's GptOssAct."""

    def __init__(self, alpha: float, limit: float, gate_up_bias: torch.Tensor, down_bias: torch.Tensor):
        assert gate_up_bias.dtype == down_bias.dtype == torch.float32 and gate_up_bias.is_contiguous() \
            and down_bias.is_contiguous()
        self.alpha, self.limit, self._held = alpha, limit, (gate_up_bias, down_bias)
        self.spec = _StepActSpec(alpha, limit, gate_up_bias.data_ptr(), down_bias.data_ptr(), gate_up_bias.stride(0),
                                 down_bias.stride(0))

    def of(self, experts: list[int]) -> GptOssAct:
        gu, dn, row_gu, row_dn = self.spec.gu_bias, self.spec.dn_bias, self.spec.gu_stride * 4, self.spec.dn_stride * 4
        return GptOssAct(self.alpha, self.limit, [gu + e * row_gu for e in experts], [dn + e * row_dn for e in experts])


def _act(act: StepAct | None):
    return ctypes.byref(act.spec) if act is not None else None


_last: NativeCall | None = None                # the call posted last: joined before the next is posted


class NativeCall:
    """A posted layer call: result() waits for it (the pool's threads and this one finish it)
    and gives its [T, E] fp32 sum, or None where the kernel did not take the shapes."""

    def __init__(self, lib: ctypes.CDLL, ticket: int, out: torch.Tensor, held: tuple):
        self._lib, self.ticket, self.out, self._held = lib, ticket, out, held
        self._rc: int | None = None

    def result(self) -> torch.Tensor | None:
        if self._rc is None:
            self._rc = self._lib.moe_layer_wait(self.ticket)
            self._held = ()
        return self.out if self._rc == 0 else None


def _a(values: array | torch.Tensor | None) -> int | None:
    """An array's or a tensor's address for a c_void_p argument (None: NULL)."""
    if isinstance(values, torch.Tensor):
        return values.data_ptr()
    return values.buffer_info()[0] if values is not None else None


def _posting() -> ctypes.CDLL:
    """The library, with the call posted last joined (its result kept: posting would join it unseen)."""
    if _last is not None:
        _last.result()
    return library()


def _posted(lib: ctypes.CDLL, ticket: int, out: torch.Tensor, held: tuple) -> NativeCall:
    global _last
    _last = NativeCall(lib, ticket, out, held)
    return _last


def moe_post(x: torch.Tensor, quant: str, shape: tuple[int, int], pointers: list[int], start: list[int],
             rows: torch.Tensor, weights: torch.Tensor, act: GptOssAct | None = None) -> NativeCall:
    """One layer's experts on the host, posted: expert i (its `addresses` at pointers[5i:5i+5])
    takes the tokens rows[start[i]:start[i+1]] (int32) with their router weights (fp32).
    shape is (intermediate size, int4 group size or 0). The caller has checked library()."""
    x = x.contiguous()
    t, e = x.shape
    inter, group = shape
    n = len(start) - 1
    out = torch.zeros(t, e, dtype=torch.float32)
    ex, at = array("q", pointers), array("q", start)      # int64 arrays: faster made than ctypes' from lists
    gate_up_bias = down_bias = None
    if act is not None:
        gate_up_bias, down_bias = array("q", act.gate_up_bias), array("q", act.down_bias)
    alpha, limit = (act.alpha, act.limit) if act is not None else (0.0, 0.0)
    lib = _posting()
    ticket = lib.moe_layer_post(_p(x), t, e, inter, code(quant), group, n, _a(ex), _a(at), _p(rows), _p(weights),
                                _p(out), alpha, limit, _a(gate_up_bias), _a(down_bias))
    return _posted(lib, ticket, out, (x, rows, weights, ex, at, gate_up_bias, down_bias))


def step_post(x: torch.Tensor, quant: str, shape: tuple[int, int], table: array, ids: array | torch.Tensor,
              weights: array | torch.Tensor, act: StepAct | None = None) -> NativeCall:
    """A decode step's experts posted straight from its routing (posted.h moe_step_post): `ids`
    (int64, distinct, 1 to STEP_MOST of them; a tensor contiguous, [k] or [1, k]) with their router
    weights (fp32, alike), expert e's parts at table[5e:5e + 5] (`addresses`, filled for these ids);
    `act` gpt-oss's (None: SwiGLU). Summed in ascending expert order, as moe_post is given them by
    the runner's grouping: the same numbers. What it reads besides x (and act's tables, which the
    family keeps) is copied at the post. The caller has checked library()."""
    x = x.contiguous()
    inter, group = shape
    n = ids.numel() if isinstance(ids, torch.Tensor) else len(ids)
    out = torch.empty(1, x.shape[1], dtype=torch.float32)            # zeroed there
    lib = _posting()
    ticket = lib.moe_step_post(_p(x), x.shape[1], inter, code(quant), group, n, _a(ids), _a(weights), _a(table),
                               _act(act), _p(out))
    return _posted(lib, ticket, out, (x,))


class _RouterSpec(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("N", ctypes.c_int64), ("k", ctypes.c_int64),
                ("sigmoid", ctypes.c_int), ("renorm", ctypes.c_int), ("groups", ctypes.c_int64),
                ("top_groups", ctypes.c_int64), ("scale", ctypes.c_float), ("w_bf16", ctypes.c_int)]


class Router:
    """A family's router as the native call takes it (models/layers.py's): the k most probable of
    softmax(x . weight^T (+ bias)), renormalised when renorm (softmax_topk); or, `sigmoid`, DeepSeek's
    grouped choice by sigmoid score + bias, weighed by the scores, normalised when renorm, times
    scale (sigmoid_router)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, renorm: bool,
                 sigmoid: bool = False, groups: int = 1, top_groups: int = 1, scale: float = 1.0):
        self.weight, self.bias, self.top_k = weight, bias, top_k
        self.spec = _RouterSpec(weight.data_ptr(), _a(bias), weight.shape[0], top_k, int(sigmoid), int(renorm),
                                groups, top_groups, scale, int(weight.dtype is torch.bfloat16))
        self._usable = top_k <= STEP_MOST and router_rows(weight) and _host_rows(bias)

    def takes(self, x: torch.Tensor) -> bool:
        return self._usable and x.dtype == torch.float32 and x.is_cpu


def route_post(x: torch.Tensor, router: Router, quant: str, shape: tuple[int, int], table: array,
               act: StepAct | None = None) -> tuple[NativeCall | None, torch.Tensor, torch.Tensor] | None:
    """A decode step routed (router.takes(x): the router's numbers, rows.h's) and, where `table`
    (step_post's, as `act`) holds the chosen experts' parts, its experts posted, in one call (posted.h
    moe_route_step_post): (the call, or None where an expert's parts must be filled in first; ids
    [1, k] int64, weights [1, k] fp32); None where the router's shapes are not taken (nothing done)."""
    x = x.contiguous()
    inter, group = shape
    ids, weights = torch.empty(1, router.top_k, dtype=torch.int64), torch.empty(1, router.top_k, dtype=torch.float32)
    out = torch.empty(1, x.shape[1], dtype=torch.float32)
    lib = _posting()
    ticket = lib.moe_route_step_post(_p(x), x.shape[1], ctypes.byref(router.spec), inter, code(quant), group, _a(table),
                                     _act(act), _p(ids), _p(weights), _p(out))
    if ticket == -1:
        return None
    return (_posted(lib, ticket, out, (x,)) if ticket >= 0 else None), ids, weights


def swiglu_post(x: torch.Tensor, gate_up, down) -> NativeCall:
    """A SwiGLU MLP of two bound host matrices (kernels.BoundMatrix) posted (posted.h
    moe_swiglu_post): the numbers of kernels.swiglu. The caller has checked kernels.swiglu_takes."""
    out = torch.empty(x.shape[0], down.rows, dtype=torch.float32)
    lib = _posting()
    ticket = lib.moe_swiglu_post(_p(x), x.shape[0], gate_up.cols, down.cols, *gate_up.args[2:], *down.args[2:], _p(out))
    return _posted(lib, ticket, out, (x, gate_up.keep, down.keep))


def post_views(x: torch.Tensor, quant: str, experts: list[dict], rows: list[torch.Tensor],
               weights: list[torch.Tensor], panels: list[bool] | None = None) -> NativeCall:
    """moe_post from part views and per-expert token rows and weights (tests, benchmarks); `panels`:
    which experts' parts are int4 in panel order (rows_to_panels)."""
    e = x.shape[1]
    inter = experts[0]["gate_up"].shape[0] // 2
    group = group_of(matrix_quants(quant)[0], e, experts[0].get("gate_up.scale"))
    start = torch.tensor([0] + [len(r) for r in rows]).cumsum(0).tolist()
    pointers = [a for i, p in enumerate(experts) for a in addresses(p, bool(panels and panels[i]))]
    return moe_post(x, quant, (inter, group), pointers, start, torch.cat(rows).to(torch.int32),
                    torch.cat(weights).float().contiguous())


def moe_layer(x: torch.Tensor, quant: str, experts: list[dict], rows: list[torch.Tensor],
              weights: list[torch.Tensor], panels: list[bool] | None = None) -> torch.Tensor | None:
    """post_views, waited for."""
    return post_views(x, quant, experts, rows, weights, panels).result()
