"""The destructor patch imported into vLLM's workers (methods.measurement.vllm_worker): a oneDNN handler
collected while torch.compile traces with fake tensors must release its real handle, not recurse."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from methods.measurement import vllm_engine, vllm_worker


class Handler:
    """Stands in for vLLM's CPUDNNLGEMMHandler: a real int64 tensor holding the handle, a release op."""

    def __init__(self, released: list[int]):
        self.handler_tensor = torch.tensor(7, dtype=torch.int64)
        self.dtor = released.append

    def __del__(self):  # vLLM 0.32's destructor
        if self.handler_tensor is not None:
            self.dtor(self.handler_tensor.item())


def test_item_of_a_real_tensor_under_fake_tensor_tracing_fails_as_in_vllm():
    # the failure the patch is for: without it, the handler's .item() is dispatched to the fake mode
    released: list[int] = []
    h = Handler(released)
    with FakeTensorMode(), pytest.raises(AssertionError, match="FakeTensor"):
        Handler.__del__(h)
    h.handler_tensor = None
    assert released == []


def test_patched_destructor_releases_the_real_handle_under_fake_tensor_tracing():
    released: list[int] = []
    h = Handler(released)
    with FakeTensorMode():
        vllm_worker._release_outside_tracing(h)
    assert released == [7]
    h.handler_tensor = None
    vllm_worker._release_outside_tracing(h)  # an unset handler releases nothing
    assert released == [7]


def test_patch_installs_on_vllms_handler_class_and_is_a_no_op_without_it(monkeypatch):
    fake_ops = types.ModuleType("vllm._custom_ops")
    fake_ops.CPUDNNLGEMMHandler = type("CPUDNNLGEMMHandler", (), {"__del__": lambda self: None})
    fake_vllm = types.ModuleType("vllm")
    fake_vllm._custom_ops = fake_ops
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.setitem(sys.modules, "vllm._custom_ops", fake_ops)
    assert vllm_worker.patch_onednn_handler()
    assert fake_ops.CPUDNNLGEMMHandler.__del__ is vllm_worker._release_outside_tracing
    del fake_ops.CPUDNNLGEMMHandler  # a build without the handler (GPU): nothing patched
    assert not vllm_worker.patch_onednn_handler()


def test_engines_name_the_worker_extension_that_vllm_imports():
    module, _, cls = vllm_engine.WORKER_EXTENSION.rpartition(".")
    assert module == vllm_worker.__name__ and getattr(vllm_worker, cls) is vllm_worker.SpecsimWorkerExtension
    # vLLM refuses an extension whose attributes collide with its worker's: it adds none
    assert not [a for a in vars(vllm_worker.SpecsimWorkerExtension) if not a.startswith("__")]
