"""PEFT adapter directories as poros-lightning writes and reads them.

A run saves a standard PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``), which
``PeftModel.from_pretrained`` loads on any resident base, plus ``poros_training.json``: how the frozen
base was quantized while the adapter trained. ``poros-lightning export`` reads that record to rebuild the
exact (dequantized) weights the adapter learned against. Saving works on a prepared (streamed) model:
PEFT keeps only the adapter tensors of ``state_dict()``, and the streamed base tensors it passes over are
views that are never copied.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from poros_lightning import quant
from poros_lightning.errors import PorosConfigError

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "TRAINING_INFO",
    "LoraFactors",
    "TrainingInfo",
    "read_lora",
    "save_adapter",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PLAN_FILE = "poros_plan.json"
"""File written next to the adapter when a strategy planned the run: the plan and its measured steps."""
TRAINING_INFO = "poros_training.json"
"""File written next to ``adapter_config.json``: how the base was quantized during training."""

_COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
_LORA_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


def _check_mode(mode: str) -> str:
    if mode not in (*quant.QUANTIZATIONS, "fp4-dq"):  # fp4-dq: a bitsandbytes load can make it
        raise ValueError(f"unknown quantization {mode!r}")
    return mode


def _quantized_on(base: nn.Module) -> str | None:
    """Where the streamed NF4 loader quantized ``base``; unknown for other loads."""
    try:
        from poros_lightning.quant.loader import load_report
    except ImportError:
        return None
    report = load_report(base)
    return None if report is None else torch.device(report.compute_device).type


@dataclass(frozen=True)
class TrainingInfo:
    """How the frozen base was quantized while the adapter trained (``poros_training.json``).

    Attributes:
        quantization: ``"nf4-dq"``, ``"nf4"``, ``"fp4"`` or ``"none"`` (see ``poros_lightning.quant``).
        compute_dtype: dtype the base weights were cast to before quantization.
        blocksize: bitsandbytes quantization block size.
        unquantized: linear layers left unquantized (qualified names or name suffixes).
        quantized_on: device type the base was quantized on (``"cpu"``, ``"cuda"``), when known.
    """

    quantization: str = "nf4-dq"
    compute_dtype: str = "bfloat16"
    blocksize: int = 64
    unquantized: tuple[str, ...] = ("lm_head",)
    quantized_on: str | None = None

    @classmethod
    def of_model(cls, model: nn.Module) -> TrainingInfo:
        """Read the settings off a (PEFT-wrapped, possibly prepared) model's 4-bit layers."""
        get_base = getattr(model, "get_base_model", None)
        base = get_base() if callable(get_base) else model
        modes, dtypes, blocks, plain = set(), set(), set(), []
        for name, module in base.named_modules():
            if quant.is_4bit_linear(module):
                state = module.weight.quant_state
                modes.add(state.quant_type + ("-dq" if getattr(state, "nested", False) else ""))
                dtypes.add(str(state.dtype).removeprefix("torch."))
                blocks.add(int(state.blocksize))
            elif type(module) is nn.Linear and not any(p.startswith("lora_") for p in name.split(".")):
                plain.append(name.removesuffix(".base_layer"))
        if not modes:
            weight = next((m.weight for m in base.modules() if type(m) is nn.Linear), None)
            dtype = str(weight.dtype).removeprefix("torch.") if weight is not None else "bfloat16"
            return cls(quantization="none", compute_dtype=dtype, unquantized=())
        if len(modes) > 1 or len(dtypes) > 1 or len(blocks) > 1:
            raise PorosConfigError(
                f"The base mixes quantization settings ({sorted(modes)}, {sorted(dtypes)}, blocksizes {sorted(blocks)}).",
                "Quantize the whole base with one mode (poros_lightning.quant.quantize_model).",
            )
        return cls(modes.pop(), dtypes.pop(), blocks.pop(), tuple(plain), _quantized_on(base))

    @classmethod
    def read(cls, adapter_dir: str | Path) -> TrainingInfo | None:
        """The settings saved next to an adapter, or ``None`` when the file is absent."""
        path = Path(adapter_dir) / TRAINING_INFO
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            info = cls(
                quantization=_check_mode(data["quantization"]),
                compute_dtype=str(data.get("compute_dtype", "bfloat16")),
                blocksize=int(data.get("blocksize", 64)),
                unquantized=tuple(data.get("unquantized", ("lm_head",))),
                quantized_on=data.get("quantized_on"),
            )
        except (ValueError, KeyError, TypeError) as err:
            raise PorosConfigError(
                f"{path} is not a valid poros-lightning training record: {err}",
                f"Fix or delete it (without it, export assumes {cls().quantization} as in a default run).",
            ) from err
        if info.compute_dtype not in _COMPUTE_DTYPES:
            raise PorosConfigError(
                f"{path}: unknown compute_dtype {info.compute_dtype!r}.", f"Use one of {list(_COMPUTE_DTYPES)}."
            )
        return info

    def write(self, adapter_dir: str | Path) -> Path:
        """Write ``poros_training.json`` into ``adapter_dir``."""
        path = Path(adapter_dir) / TRAINING_INFO
        path.write_text(json.dumps({**asdict(self), "unquantized": list(self.unquantized)}, indent=2) + "\n")
        return path

    def quantizes(self, module_name: str) -> bool:
        """Whether training quantized the linear layer ``module_name``."""
        if self.quantization == "none":
            return False
        return not any(module_name == s or module_name.endswith("." + s) for s in self.unquantized)


def save_adapter(model: nn.Module, directory: str | Path) -> Path:
    """Write a standard PEFT adapter directory plus ``poros_training.json``; works while prepared.

    A model a strategy planned for also gets ``poros_plan.json``: the budget, the options chosen and why, and
    what the first steps measured (it changes nothing of the adapter: every plan trains the same bits).

    Args:
        model: a ``peft.PeftModel`` (prepared for streaming or not).
        directory: created if needed; files inside are overwritten.

    Returns:
        The directory.
    """
    if not callable(getattr(model, "save_pretrained", None)) or not hasattr(model, "peft_config"):
        raise PorosConfigError(
            f"save_adapter needs a peft.PeftModel, got {type(model).__name__}.",
            "Pass the model returned by peft.get_peft_model (LoRALightningModule keeps it as .model).",
        )
    info = TrainingInfo.of_model(model)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    info.write(path)
    plan = getattr(model, "_poros_plan", None)
    if plan is not None:
        (path / PLAN_FILE).write_text(json.dumps(plan, indent=2, default=str) + "\n")
    return path


@dataclass(frozen=True)
class LoraFactors:
    """The LoRA factors of one linear layer, as float32, and the scale of their product (``alpha / r``, or
    ``alpha / sqrt(r)`` with rsLoRA)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    def delta(self) -> torch.Tensor:
        """The weight update ``scaling * B @ A`` in float32."""
        return (self.b @ self.a) * self.scaling  # PEFT's get_delta_weight, in float32


def read_lora(adapter_dir: str | Path) -> tuple[dict[str, Any], dict[str, LoraFactors]]:
    """Read a PEFT LoRA adapter directory: its config and, per adapted linear layer, its factors.

    Args:
        adapter_dir: directory with ``adapter_config.json`` and ``adapter_model.safetensors``.

    Returns:
        ``(adapter_config, {module name in the base model: LoraFactors})``.

    Raises:
        PorosConfigError: a file is missing, or the adapter is not plain LoRA on linear layers.
    """
    from peft.utils.other import get_pattern_key
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    config_path, weights_path = adapter_dir / ADAPTER_CONFIG, adapter_dir / ADAPTER_WEIGHTS
    missing = [p.name for p in (config_path, weights_path) if not p.is_file()]
    if missing:
        raise PorosConfigError(
            f"{adapter_dir} is not a PEFT adapter directory: {', '.join(missing)} missing.",
            "Pass the directory written by model.save_pretrained(dir) / the SaveAdapter callback "
            "(adapter_model.bin is not read: re-save with safe_serialization=True).",
        )
    config = json.loads(config_path.read_text())
    unsupported = {
        "peft_type": config.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(config.get("use_dora")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "lora_bias": bool(config.get("lora_bias")),
        "use_qalora": bool(config.get("use_qalora")),
        "layer_replication": bool(config.get("layer_replication")),
        "target_parameters": bool(config.get("target_parameters")),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise PorosConfigError(
            f"{config_path}: export merges plain LoRA on linear layers; this adapter sets {bad}.",
            "Merge it with PEFT instead: PeftModel.from_pretrained(base, dir).merge_and_unload().",
        )
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in load_file(str(weights_path)).items():
        match = _LORA_KEY.match(key)
        if match is None:
            raise PorosConfigError(
                f"{weights_path}: tensor {key!r} is not a LoRA factor of a linear layer "
                "(embedding adapters, modules_to_save and trainable biases are not merged by export).",
                "Merge it with PEFT instead: PeftModel.from_pretrained(base, dir).merge_and_unload().",
            )
        factors.setdefault(match["module"], {})[match["ab"]] = value.float()
    loras, patterns = {}, config.get("alpha_pattern") or {}
    for module, ab in sorted(factors.items()):
        if set(ab) != {"A", "B"} or ab["B"].shape[1] != ab["A"].shape[0]:
            raise PorosConfigError(
                f"{weights_path}: the LoRA factors of {module!r} are incomplete or do not chain.",
                "The file is damaged: save the adapter again from the trained model or its checkpoint.",
            )
        r = ab["A"].shape[0]  # rank_pattern shows in the shapes
        alpha = patterns.get(get_pattern_key(patterns, module), config.get("lora_alpha", 8))
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r  # as PEFT's LoraLayer computes it
        loras[module] = LoraFactors(ab["A"], ab["B"], scaling)
    if not loras:
        raise PorosConfigError(f"{weights_path} holds no LoRA weights.", "Check that the run saved its adapter.")
    return config, loras
