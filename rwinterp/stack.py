"""Several models of one architecture run as one computation: PyTorch's model-ensembling recipe.

Models that differ only in their weights (one per seed) can be run together: stack each parameter along a
new first dimension (``[seeds, ...]``) and map the model's own forward pass over that dimension with
:func:`torch.func.vmap`. Every operation then runs once on the stacked tensors (a matmul becomes a batched
matmul, a softmax one softmax over all seeds), instead of once per model: one computation with one
Python-level pass and one kernel launch per operation. Autograd runs through the mapped forward pass as
usual, so one ``backward()`` of the summed losses gives every model's gradient in the stacked parameters'
``.grad`` (each model's loss depends only on its own slice), and an optimiser stepping the stacked
parameters steps every model.

What it saves is the per-operation cost (Python, dispatch, a GPU's kernel launches), not arithmetic: each
model still does its own. A small model on a GPU, which alone leaves the device idle, gains the most; on a
CPU a model as small as the paper's Fig 4 setting is already mostly arithmetic, and a batch of 20 costs
about 5 times one seed where 20 runs in turn cost about 19 to 23 (``benchmarks/bench_seeds.py``).

:class:`ModelStack` does the bookkeeping:

* The stacked parameters are leaf tensors ``[seeds, ...]``; each model's own parameters become views of its
  slice, so the models always hold the current weights (a probe, a callback or ``state_dict()`` read them
  directly) until :meth:`ModelStack.release` gives every model its own storage again.
* Buffers that are the same in every model (fixed embeddings, masks) are shared, not stacked; those that
  differ (a Gaussian model's stored initial W) or that training changes are stacked like parameters.
* :meth:`ModelStack.map` runs a function of one model under ``vmap``: the first model stands for all of
  them, its tensors replaced by the stacked ones (by name, in every module that holds them, so models whose
  modules share a parameter under several names, such as TransformerLens bridges, are handled).
  :meth:`ModelStack.call` runs a function that computes the whole stack itself, with no ``vmap`` (the paper's
  model: :meth:`rwinterp.model.DeepTransformer.computes_stacks`).

What may run under ``vmap``: the model's forward pass must not read its data in Python (``int(x)``,
``if x.any()``); :class:`rwinterp.model.DeepTransformer` takes ``check=False`` to leave its token check to
the caller, and its custom autograd Functions have ``vmap`` rules. Each model's numbers equal those of the
model run alone up to round-off of the order of the last bit (a batched matmul may sum in another order
than a plain one); the sums that the library keeps exact (:class:`rwinterp.model.SymmetricReadout`) stay
exact.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from rwinterp.errors import require


def _owners(model: nn.Module, kind: str) -> dict[int, list[tuple[nn.Module, str]]]:
    """For every parameter (``kind="_parameters"``) or buffer (``"_buffers"``) of ``model``, by ``id``: every
    ``(module, attribute)`` that holds it, aliases included."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for attr, tensor in getattr(module, kind).items():
            if tensor is not None and (module, attr) not in owners.setdefault(id(tensor), []):
                owners[id(tensor)].append((module, attr))
    return owners


class ModelStack:
    """``models`` (one architecture, one device, one dtype) as stacked tensors; see the module docstring.

    ``stacked_buffers`` names buffers to stack even where every model holds the same values (buffers that
    training changes in place, such as a decaying initial W). ``chunk_size``: run the models this many at a
    time (``vmap``'s ``chunk_size``; default all at once), to bound the memory of one pass."""

    def __init__(self, models: Sequence[nn.Module], stacked_buffers: Sequence[str] = (),
                 chunk_size: Optional[int] = None):
        models = list(models)
        require(len(models) >= 1, "a stack needs at least one model")
        require(len({id(m) for m in models}) == len(models), "the same model appears twice in the stack")
        template = models[0]
        require(all(type(m) is type(template) for m in models), "the models of a stack must be of one class")
        self.models = models
        self.template = template
        named = [dict(m.named_parameters()) for m in models]
        buffers = [dict(m.named_buffers()) for m in models]
        for params, bufs in zip(named[1:], buffers[1:]):
            require(list(params) == list(named[0]) and list(bufs) == list(buffers[0]),
                    "the models of a stack must have the same parameters and buffers")
            for name, tensor in (*params.items(), *bufs.items()):
                first = named[0].get(name, buffers[0].get(name))
                require(tensor.shape == first.shape and tensor.dtype == first.dtype and tensor.device == first.device,
                        f"the models of a stack differ in {name} ({list(tensor.shape)} {tensor.dtype} {tensor.device}"
                        f" against {list(first.shape)} {first.dtype} {first.device})")
        self.size = len(models)
        self.chunk_size = chunk_size
        with torch.no_grad():
            self.params: dict[str, Tensor] = {
                name: torch.stack([p[name].detach() for p in named]).requires_grad_(tensor.requires_grad)
                for name, tensor in named[0].items()}
            self.buffers: dict[str, Tensor] = {
                name: torch.stack([b[name] for b in buffers]) for name, tensor in buffers[0].items()
                if name in stacked_buffers or not all(torch.equal(b[name], tensor) for b in buffers[1:])}
        self._param_owners = [_owners(m, "_parameters") for m in models]
        self._buffer_owners = [_owners(m, "_buffers") for m in models]
        self._template_params = named[0]
        self._attach()

    # ------------------------------------------------------------------ the models' own tensors
    def _attach(self) -> None:
        """Make every model's parameters and stacked buffers views of its slice of the stack."""
        with torch.no_grad():
            for s, model in enumerate(self.models):
                for name, param in model.named_parameters():
                    param.data = self.params[name].detach()[s]
                for name, buffer in list(model.named_buffers()):
                    if name in self.buffers:
                        self._set_buffer(s, buffer, self.buffers[name][s])

    def _set_buffer(self, s: int, old: Tensor, new: Tensor) -> None:
        for module, attr in self._buffer_owners[s].get(id(old), []):
            module._buffers[attr] = new
        self._buffer_owners[s][id(new)] = self._buffer_owners[s].pop(id(old), [])

    def release(self) -> None:
        """Give every model its own copy of its weights (they stop being views of the stack)."""
        with torch.no_grad():
            for s, model in enumerate(self.models):
                for param in model.parameters():
                    param.data = param.data.clone()
                for name, buffer in list(model.named_buffers()):
                    if name in self.buffers:
                        self._set_buffer(s, buffer, buffer.clone())

    # ------------------------------------------------------------------ running
    @contextmanager
    def _substituted(self, tensors: dict[str, Tensor]) -> Iterator[nn.Module]:
        """The first model with its parameters and stacked buffers replaced by ``tensors`` (by name)."""
        saved = []
        try:
            for name, tensor in tensors.items():
                if name in self._template_params:
                    kind, owners = "_parameters", self._param_owners[0][id(self._template_params[name])]
                else:
                    kind, owners = "_buffers", self._buffer_owners[0][id(self.models[0].get_buffer(name))]
                for module, attr in owners:
                    table = getattr(module, kind)
                    saved.append((table, attr, table[attr]))
                    table[attr] = tensor
            yield self.template
        finally:
            for table, attr, old in reversed(saved):
                table[attr] = old

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(model, *args)`` once, the model holding the stacked tensors themselves (``[models, ...]``), for a
        function that computes every model at once along that leading axis (``args`` carry it too): no ``vmap``
        and none of its cost per operation."""
        with self._substituted({**self.params, **self.buffers}) as model:
            return fn(model, *args)

    def map(self, fn: Callable[..., Any], *args: Any, in_dims: Sequence[Any]) -> Any:
        """``fn(model, *args)`` for every model at once: ``vmap`` over the stack, ``args`` mapped along
        ``in_dims`` (``0``: one slice per model; ``None``: the same for every model). Returns ``fn``'s outputs
        with the models along a new first dimension."""
        def one(params: dict[str, Tensor], buffers: dict[str, Tensor], *data: Any) -> Any:
            with self._substituted({**params, **buffers}) as model:
                return fn(model, *data)

        with warnings.catch_warnings():
            # An operation without a batching rule (the fused CPU attention kernel) runs once per model, as each
            # model alone runs it; torch's warning about it tells the user nothing they can act on.
            warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")
            return torch.func.vmap(one, in_dims=(0, 0, *in_dims), chunk_size=self.chunk_size)(
                self.params, self.buffers, *args)
