"""Imported inside vLLM's worker processes (vLLM's ``worker_extension_cls``), before they load the model.

vLLM's CPU build (0.32) wraps each oneDNN GEMM in a ``CPUDNNLGEMMHandler`` whose ``__del__`` reads its
handle with ``Tensor.item()``. Some handlers are only freed by Python's cyclic garbage collector (the draft's
own ``lm_head`` / embedding once the target's are shared with an EAGLE head, for one); when a collection
happens while torch.compile traces the model at start-up, a fake-tensor mode is active, the ``.item()`` of
the handler's real tensor is dispatched to it, fails, and formatting the error calls ``.item()`` again: the
worker dies with "Fatal Python error: _Py_CheckRecursiveCall: Cannot recover from stack overflow". Whether
it happens depends on when the collector runs, i.e. on the graph traced: the zoo target tapped at vLLM's
EAGLE-3 auxiliary layers (2, 4, 6) crashed on every start, (1, 3, 5) did not; with the collector disabled
in the worker, or with ``enforce_eager``, (2, 4, 6) starts. Importing this module makes the handler release
its handle with the tracing modes set aside, which is what the destructor means to do.
"""

from __future__ import annotations


def _release_outside_tracing(self) -> None:
    """``CPUDNNLGEMMHandler.__del__`` with any torch dispatch mode (fake tensors, proxies) popped first."""
    if getattr(self, "handler_tensor", None) is None:
        return
    from torch.utils._python_dispatch import _disable_current_modes  # noqa: PLC0415

    with _disable_current_modes():
        self.dtor(self.handler_tensor.item())


def patch_onednn_handler() -> bool:
    """Install the safe destructor; False where this vLLM has no such handler (GPU builds, other
    releases): nothing to do there."""
    try:
        from vllm import _custom_ops  # noqa: PLC0415 (optional dependency; only inside vLLM's processes)
    except ImportError:
        return False
    handler = getattr(_custom_ops, "CPUDNNLGEMMHandler", None)
    if handler is None or not hasattr(handler, "__del__"):
        return False
    handler.__del__ = _release_outside_tracing
    return True


class SpecsimWorkerExtension:
    """Named to vLLM as ``worker_extension_cls`` so that its workers import this module (and patch) before
    loading and compiling the model. Adds no methods to the worker."""


patch_onednn_handler()
