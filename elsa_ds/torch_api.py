"""torch's underscored APIs that elsa_ds calls outside the DeepSpeed adapter (``zero/compat.py``), in one place.

The multi-tensor ("foreach") ops are what ``torch.optim`` steps many tensors with: one launch for a list of tensors on a
GPU, torch's per-tensor ops on a CPU (so a CPU run's arithmetic is the per-tensor code's to the bit). Documented as beta
under their underscored names; read off torch 2.13 (``native_functions.yaml``: ``_foreach_norm.Scalar`` takes a
``dtype``, ``_foreach_copy_`` copies across dtypes). The compiler's switches and counters are dynamo's
(``torch._dynamo.config``, ``torch._dynamo.utils.counters``). The math core calls these, never DeepSpeed's internals.

And one workaround of a torch CPU wheel's bug that every process needs before its first two-thread op:
:func:`resolve_mkl_vml`.
"""
from __future__ import annotations

import torch

Tensors = list[torch.Tensor]


def foreach_sub(a: Tensors, b: Tensors) -> Tensors:
    """[x − y for x, y in zip(a, b)]."""
    return list(torch._foreach_sub(a, b))


def foreach_add_(a: Tensors, b: Tensors, alpha: float = 1.0) -> None:
    """x.add_(y, alpha=alpha) for each pair."""
    torch._foreach_add_(a, b, alpha=alpha)


def foreach_mul_(a: Tensors, factor: torch.Tensor | float) -> None:
    """x.mul_(factor) for each x (``factor`` a 0-dim tensor or a number)."""
    torch._foreach_mul_(a, factor)


def foreach_copy_(dst: Tensors, src: Tensors) -> None:
    """d.copy_(s) for each pair, across dtypes (rounded as ``copy_`` rounds)."""
    torch._foreach_copy_(dst, src)


def foreach_norm(a: Tensors, dtype: torch.dtype | None = None) -> Tensors:
    """The 2-norm of each tensor, accumulated and returned in ``dtype`` (as ``x.to(dtype).norm(2)``)."""
    return list(torch._foreach_norm(a, 2.0, dtype=dtype))


def compile_errors_run_eagerly() -> None:
    """A graph the backend fails to compile runs eagerly instead of raising (process-wide), its backward included: that
    is compiled with its forward (AOTAutograd's lazy backward compile ran outside dynamo's error handling: a failing
    backward raised in ``.backward()``); the caches and :func:`compile_counts` start empty (dynamo's reset keeps the
    counters). A kernel that fails while it runs still raises."""
    import torch._dynamo
    import torch._functorch.config
    from torch._dynamo.utils import counters

    torch._dynamo.config.suppress_errors = True
    torch._functorch.config.force_non_lazy_backward_lowering = True
    torch._dynamo.reset()
    counters.clear()


def compile_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) in this process since the last reset."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


# torch's contiguous fp32/fp64 unary ops that call oneMKL's VML (``aten/src/ATen/cpu/vml.h``, IMPLEMENT_VML_MKL), each
# from every intra-op thread on its chunk of >= 2048 entries
MKL_VML_OPS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2", "sin", "sqrt", "tan",
               "tanh", "trunc")
_vml_resolved = False


def resolve_mkl_vml() -> None:
    """Each of torch's MKL VML ops called once, on one thread, on one entry of fp32 and of fp64, so that none makes its
    first call from two threads at once. oneMKL 2024.2 (torch 2.13's CPU wheels) picks a VML function's kernel on its
    first call; first calls made concurrently can run one thread's whole chunk through a low-accuracy kernel (AVX2 "EP",
    ~1e-4 relative) despite torch asking for VML_HA: pytorch/pytorch#188792. Seen here: the first 8-bit Adam step's
    ``v.sqrt()`` of a test wrong in the second thread's half, reproduced bit for bit with that kernel (docs/history.md).
    Call at the start of a process (every job's rank, the evaluation, the sparse loader); ~6 ms the first time, then nothing."""
    global _vml_resolved
    if _vml_resolved or not torch.backends.mkl.is_available():
        return
    for dtype in (torch.float32, torch.float64):
        one = torch.full((1,), 0.5, dtype=dtype)
        for name in MKL_VML_OPS:
            getattr(torch, name)(one)
    _vml_resolved = True


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter: autograd's count of the in-place writes to its storage (``copy_`` by load_state_dict,
    ``fill_``, an optimizer's step), so a reader can tell that a tensor it checked has changed since. -1 for a tensor
    made under ``torch.inference_mode()``, which keeps none (its writes go uncounted)."""
    return -1 if t.is_inference() else int(t._version)


def prepare_torch_for_zero_init() -> None:
    """torch 2.13: import dynamo's tensor polyfills before ``zero.Init`` patches ``torch.Tensor.__new__`` (inside it they break)."""
    import torch._dynamo.polyfills.tensor  # noqa: F401


def cpu_bf16_matmul_is_fast() -> bool:
    """Whether oneDNN runs bf16 matmuls on this CPU (AVX-512 or AMX); torch takes a slow reference loop elsewhere."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()
