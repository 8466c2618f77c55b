"""Live and peak bytes of the tensors created inside a `with PeakMeter():` block, on any device (the CPU has no
torch.cuda.max_memory_allocated): every op's outputs are counted once per storage until the storage is freed."""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakMeter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._storages: dict[int, weakref.ref] = {}

    def _count(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, n = storage._cdata, storage.nbytes()
        if n == 0 or key in self._storages:
            return

        def freed(_, key=key, n=n):
            self.live -= n
            self._storages.pop(key, None)

        self._storages[key] = weakref.ref(storage, freed)
        self.live += n
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._count(t)
        return out
