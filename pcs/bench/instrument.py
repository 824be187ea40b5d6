"""What the bench measures with: peak memory (``PeakMemory``), the compression's own seconds
(``CompressionClock``), the operations one layer's compression dispatches (``CompressionOps``: on a GPU each a
launch or a copy the host issues), the attention calls of a decoding step, and a profile of one prefill."""
from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..eviction.base import Watched
from ..generate import greedy_generate


class PeakMemory:
    """Peak extra memory while active: CUDA's allocator statistics, or sampled RSS on CPU."""

    def __init__(self, device: torch.device):
        self.device, self.peak, self.base = device, 0, 0

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = self.peak = self.rss()
            self.running = True
            self.thread = threading.Thread(target=self.sample, daemon=True)
            self.thread.start()
        return self

    def sample(self):
        while self.running:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self.running = False
            self.thread.join()
        self.extra = max(0, self.peak - self.base)


def profile_prefill(model, method, ids, path: Path, options=None, repeat=None) -> float:
    """One prefill plus compression under torch.profiler; writes its op table to ``path`` and returns
    the share of the time spent compressing (ops under the ``pcs.compress`` label)."""
    from torch.profiler import ProfilerActivity, profile
    on_cuda = next(model.parameters()).device.type == "cuda"      # the prompt may still be on the host
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        greedy_generate(model, ids, method, 1, set(), options=options, repeat=repeat)
    averages = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in averages)
    compress = sum(e.cpu_time_total for e in averages if e.key == "pcs.compress")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(averages.table(sort_by="self_cpu_time_total", row_limit=30)
                    + ("\n" + averages.table(sort_by="self_cuda_time_total", row_limit=30) if on_cuda else "")
                    + "\n" + compression_breakdown(prof.events()))
    return compress / total if total else 0.0


def compression_breakdown(events) -> str:
    """What the ops inside the ``pcs.compress`` spans did, per operator: calls, kernels they launched, those kernels'
    device time and the host's own time in the operator (the whole-prefill tables above mix them with the forward's),
    per compressed layer; the most device time first, then the most host time (on a CPU, where there is no device)."""
    totals: dict[str, list] = {}
    # The host's spans only: with CUDA activity the profiler also lists each span once more as a device-side
    # annotation, which has no operators under it and would halve the figures per layer.
    spans = [e for e in events if e.name == "pcs.compress" and e.device_type == torch.autograd.DeviceType.CPU]

    def walk(event):
        for child in event.cpu_children:
            calls_kernels_device_host = totals.setdefault(child.name, [0, 0, 0.0, 0.0])
            calls_kernels_device_host[0] += 1
            calls_kernels_device_host[1] += len(child.kernels)
            calls_kernels_device_host[2] += child.self_device_time_total / 1000
            calls_kernels_device_host[3] += child.self_cpu_time_total / 1000
            walk(child)
    for span in spans:
        walk(span)
    layers = max(1, len(spans))
    lines = [f"Inside pcs.compress, per compressed layer ({len(spans)} spans): operator, calls, kernels, device ms, "
             "host ms",
             *(f"{name:<48} {calls / layers:8.1f} {kernels / layers:8.1f} {device / layers:9.3f} {host / layers:9.3f}"
               for name, (calls, kernels, device, host) in sorted(totals.items(),
                                                                  key=lambda kv: (-kv[1][2], -kv[1][3], -kv[1][0])))]
    return "\n".join(lines) + "\n"


ATTENTION_OP = "aten::scaled_dot_product_attention"
CALLS_CONTEXT = 4096    # tokens of the prompt the attention calls are counted on: how many calls a decode step
                        # makes per layer does not depend on the prompt's length, and one more prefill of 128K
                        # tokens per configuration would cost minutes of device time


def attention_calls_per_token(model, method, ids, steps: int = 4, options=None, repeat=None) -> float:
    """Attention calls (all layers) per decoded token, counted by the profiler over ``steps`` decoding
    steps: a prefill's calls alone (one per layer, and a reconstruction's) are counted apart and subtracted. CPU
    events only: tracing the GPU's kernels too (CUPTI) costs minutes per configuration at 128K and is not needed to
    count calls."""
    from torch.profiler import ProfilerActivity, profile

    def calls(tokens: int) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            greedy_generate(model, ids, method, tokens, set(), options=options, repeat=repeat)
        return sum(e.count for e in prof.key_averages() if e.key == ATTENTION_OP)
    return (calls(steps + 1) - calls(1)) / steps


# Operations that dispatch no work to a device: views, allocations, conjugation flags.
NO_WORK_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
               "detach_", "resolve_conj", "resolve_neg", "alias"}


class CompressionOps:
    """Operations a method's compression (its ``keep``, layer by layer) dispatches, views and allocations aside,
    counted for ``method``: the method watched (``Watched``), to run instead of it. On a GPU each operation is at
    least one kernel launch or copy the host issues, so this counts what a prefill's host spends on compressing,
    deterministically where timings are noisy; a selection whose count grows with the prompt would cost launches
    per token on an accelerator. Only ``keep`` runs under the counting dispatch mode: the forward around it runs
    as it would."""

    def __init__(self, method):
        self.ops, self.layers = 0, 0
        self.method = Watched(method, self.counting)

    @property
    def per_layer(self) -> float:
        return self.ops / max(1, self.layers)

    @contextlib.contextmanager
    def counting(self):
        self.layers += 1
        with _OpCounter(self):
            yield

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


class StepOps:
    """Operations one eager decoding step dispatches (``counting()`` around it), views and allocations aside: on a
    GPU each is at least one kernel launch, so a step's count per layer is what a captured or compiled step would
    have to fold."""

    def __init__(self):
        self.ops = 0

    def counting(self):
        return _OpCounter(self)


class _OpCounter(TorchDispatchMode):
    def __init__(self, owner):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func._overloadpacket.__name__ not in NO_WORK_OPS:
            self.owner.ops += 1
        return func(*args, **(kwargs or {}))


class StepKernels:
    """Kernels one decoding step runs, read from a profile of it (``counting()`` around the step): on CUDA the
    device's kernels, a replayed graph's included; on a CPU the work its forward calls at the top, an eager step's
    operators or a compiled step's fused kernels, matrix products and operators (views and allocations aside), what
    each would launch on a GPU."""

    def __init__(self):
        self.kernels = 0

    @contextlib.contextmanager
    def counting(self):
        from torch.profiler import ProfilerActivity, profile
        cuda = torch.cuda.is_available()
        with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
            yield
        events = prof.events()
        if cuda:
            self.kernels = sum(e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Memcpy")
                               and not e.name.startswith("Memset") for e in events)
        else:
            self.kernels = sum(is_work(e.name) and not any(map(is_kernel, ancestors(e))) for e in events)


def is_kernel(name: str) -> bool:
    """A fused kernel of a compiled graph, or an operator (``aten::mm``, ``pcs::decode_attention``)."""
    return "cpp_fused" in name or "::" in name


def is_work(name: str) -> bool:
    """A kernel that does work on the device: neither a view nor an allocation."""
    if not is_kernel(name):
        return False
    if "::" not in name:
        return True
    namespace, op = name.split("::", 1)
    if op in NO_WORK_OPS:
        return False
    packet = getattr(getattr(torch.ops, namespace, None), op, None)
    return not any(getattr(packet, o).is_view for o in packet.overloads()) if packet is not None else True


def ancestors(event):
    event = event.cpu_parent
    while event is not None:
        yield event.name
        event = event.cpu_parent


class CompressionClock:
    """Seconds a method spends choosing what to keep (its ``keep``, layer by layer) when run as ``method`` (the
    method watched, ``Watched``): the part of the prefill in which selections differ, timed by CUDA events on a
    GPU so that nothing waits for it, read once the clock's context exits."""

    def __init__(self, method, device: torch.device):
        self.device, self.spans, self.seconds = device, [], 0.0
        self.method = Watched(method, self.timing)

    @contextlib.contextmanager
    def timing(self):
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans.append((start, end))
        else:
            start = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - start

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.spans:
            torch.cuda.synchronize()
            self.seconds += sum(start.elapsed_time(end) for start, end in self.spans) / 1000
