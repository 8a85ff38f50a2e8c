"""The meta-device skeleton a quantized load fills, and where each checkpoint tensor goes.

Shared by the streamed loader (:mod:`poros_lightning.quant.loader`) and the NF4 cache
(:mod:`poros_lightning.quant.cache`), which fill it from a checkpoint or from a cache entry.
Invariant: a 4-bit weight is quantized on the compute device exactly as a resident bitsandbytes load
does, and only its packed bytes and quant state stay, on the CPU (see the loader's Note: [memory]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from poros_lightning.errors import PorosConfigError
from poros_lightning.quant import _MODES, _linear_names, bnb, disable_cpu_repacking

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["LoadReport", "Skeleton", "load_report"]


_REPORT = "_poros_load_report"


@dataclass
class LoadReport:
    """How a base was loaded (attached to the model; read it with :func:`load_report`)."""

    source: str  # "checkpoint", "cache" or "random"
    compute_device: str
    quantization: str
    quantized_layers: int
    bytes_read: int
    seconds: float
    cache_entry: str | None = None
    cache_rebuild_reason: str | None = None
    cache_write_seconds: float | None = None


def load_report(model: nn.Module) -> LoadReport | None:
    """The :class:`LoadReport` of a model returned by this module's loaders, else ``None``."""
    return getattr(model, _REPORT, None)


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Register every new parameter on the meta device; buffers are built (and computed) as usual."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        param = module._parameters.get(name)
        if param is not None and param.device.type != "meta":
            kwargs = {k: v for k, v in param.__dict__.items() if k != "requires_grad"}
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad, **kwargs)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _hf_config(config: dict[str, Any] | PretrainedConfig) -> PretrainedConfig:
    from poros_lightning.quant.hf_config import hf_config

    return hf_config(config)


def _check_arch(config: PretrainedConfig, allow_unlisted: bool) -> None:
    from poros_lightning.arch import arch_for_config

    arch_for_config(config.to_dict(), allow_unlisted=allow_unlisted)


def _compute_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise PorosConfigError(f"Cannot quantize on {device}.", "Use compute_device='cuda' or 'cpu'.")
    return device


class Skeleton:
    """A meta-device model and where each checkpoint tensor goes (see Note: [tied weights])."""

    def __init__(
        self,
        config: PretrainedConfig,
        quantization: str,
        dtype: torch.dtype,
        attn: str | None,
        auto_class: Any = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        from poros_lightning.quant.hf_config import build_from_config

        kwargs = {"attn_implementation": attn} if attn else {}
        with _params_on_meta():
            self.model = build_from_config(auto_class or AutoModelForCausalLM, config, dtype=dtype, **kwargs)
        self.dtype = dtype
        self.quantization = quantization
        self.linear_weights = {f"{n}.weight" for n in _linear_names(self.model, ("lm_head",))}
        self.four_bit: dict[str, nn.Module] = {}
        if quantization != "none":
            self._to_linear4bit()
        self.sites: dict[str, list[tuple[nn.Module, str, bool]]] = {}
        self.alias: dict[str, str] = {}
        self.specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        first: dict[int, str] = {}
        for mod_name, module in self.model.named_modules(remove_duplicate=False):
            prefix = f"{mod_name}." if mod_name else ""
            for attr, param in module._parameters.items():
                if param is not None:
                    self._site(first, prefix + attr, module, attr, param, True)
            for attr, buf in module._buffers.items():
                if buf is not None and attr not in module._non_persistent_buffers_set:
                    self._site(first, prefix + attr, module, attr, buf, False)
        self.params = [n for n, sites in self.sites.items() if sites[0][2]]
        """Canonical names of the parameters, in module order."""
        self.loaded: set[str] = set()

    def _site(
        self, first: dict[int, str], name: str, module: nn.Module, attr: str, t: torch.Tensor, param: bool
    ) -> None:
        canonical = first.setdefault(id(t), name)
        self.alias[name] = canonical
        sites = self.sites.setdefault(canonical, [])
        if all(m is not module or a != attr for m, a, _ in sites):
            sites.append((module, attr, param))
        if canonical == name:
            self.specs[name] = (t.dtype, tuple(t.shape))

    def _to_linear4bit(self) -> None:
        quant_type, double_quant = _MODES[self.quantization]
        lib = bnb()
        for weight in sorted(self.linear_weights):
            path = weight.rsplit(".", 1)[0]
            parent_name, _, child = path.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            old: nn.Linear = getattr(parent, child)
            new = lib.nn.Linear4bit(
                old.in_features,
                old.out_features,
                bias=old.bias is not None,
                compute_dtype=self.dtype,
                compress_statistics=double_quant,
                quant_type=quant_type,
                device="meta",
            )
            new.weight = lib.nn.Params4bit(
                torch.empty(old.weight.shape, dtype=self.dtype, device="meta"),
                requires_grad=False,
                compress_statistics=double_quant,
                quant_type=quant_type,
                module=new,
            )
            if old.bias is not None:  # as quantize_model: the bias of a 4-bit layer is frozen
                new.bias = nn.Parameter(old.bias, requires_grad=False)
            new.support_avx512bf16_for_cpu = False
            new.train(old.training)
            setattr(parent, child, new)
            self.four_bit[weight] = new

    def target(self, key: str) -> str | None:
        """The canonical name a checkpoint key loads into; None when the model has no such tensor."""
        for candidate in _candidates(key):
            if candidate in self.alias:
                canonical = self.alias[candidate]
                return canonical if canonical == candidate else ""
        return None

    def expect(self, name: str, tensor: torch.Tensor) -> None:
        shape = self.specs[name][1]
        if tuple(tensor.shape) != shape:
            raise PorosConfigError(
                f"Checkpoint tensor {name} has shape {tuple(tensor.shape)}, the model built from config.json "
                f"expects {shape}.",
                "The checkpoint and its config.json disagree; re-download or re-save the checkpoint.",
            )

    def assign(self, name: str, tensor: torch.Tensor) -> None:
        """Store an unquantized tensor (cast to its dtype, on the CPU) at every place it is registered."""
        self.expect(name, tensor)
        value = tensor.to(device="cpu", dtype=self.specs[name][0])
        sites = self.sites[name]
        if sites[0][2]:
            value = nn.Parameter(value, requires_grad=sites[0][0]._parameters[sites[0][1]].requires_grad)
        for module, attr, is_param in sites:
            (module._parameters if is_param else module._buffers)[attr] = value
        self.loaded.add(name)

    def finish(self, report: LoadReport) -> PreTrainedModel:
        missing = [n for n in self.params if n not in self.loaded]
        if missing:
            raise PorosConfigError(
                f"The checkpoint has no tensor for {len(missing)} parameter(s) of the model, e.g. {missing[:5]}.",
                "Check that config.json belongs to these weights (model_type, layer count, tie_word_embeddings).",
            )
        disable_cpu_repacking(self.model)
        self.model.train()
        setattr(self.model, _REPORT, report)
        return self.model


def _candidates(key: str) -> Iterator[str]:
    """The key itself, then the renames transformers applies for the registered families."""
    yield key
    if key.startswith("model.language_model."):  # multimodal checkpoint, text-only model
        yield "model." + key[len("model.language_model.") :]
    if key.startswith("language_model.model."):  # older multimodal layout
        yield "model.language_model." + key[len("language_model.model.") :]
    if key.startswith("language_model.lm_head."):
        yield key[len("language_model.") :]
    if not key.startswith("model."):  # a base-model checkpoint without the causal LM prefix
        yield "model." + key


def _quantize_weight(lin: nn.Module, weight: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
    """Quantize ``weight`` on ``device`` exactly as a resident bitsandbytes load does; keep the result on the CPU."""
    lib = bnb()
    quant_type, double_quant = lin.weight.quant_type, lin.weight.compress_statistics
    param = lib.nn.Params4bit(
        weight.to(device=device, dtype=dtype).contiguous(),
        requires_grad=False,
        compress_statistics=double_quant,
        quant_type=quant_type,
        module=lin,
    ).to(device)
    if device.type != "cpu":  # keep the packed bytes and the state on the host; no engine holds them yet
        param.data = param.data.cpu()
        param.quant_state.to("cpu")
    lin.weight = param


def _place(sk: Skeleton, name: str, tensor: torch.Tensor, device: torch.device) -> None:
    lin = sk.four_bit.get(name)
    if lin is None:
        sk.assign(name, tensor)
        return
    sk.expect(name, tensor)
    _quantize_weight(lin, tensor, device, sk.dtype)
    sk.loaded.add(name)
