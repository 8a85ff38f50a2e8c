"""LoRALightningModule: any registered Hugging Face causal LM, frozen and quantized, with a PEFT LoRA adapter.

The module builds the base and applies LoRA in ``__init__``, in that order, under the caller's RNG state:
LoRA's init draws from the global RNG, so two runs that seed identically before constructing the module
(``seed_everything``, LightningCLI's ``seed_everything``, or ``seed=``) start from identical adapters.
Only the adapter trains, only the adapter is optimized, and only the adapter is checkpointed.

Any LightningModule that holds a PEFT-wrapped causal LM as an attribute works with ``PorosStrategy``;
this one is the ready-made recipe.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch.nn.modules.module import _IncompatibleKeys
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from poros_lightning.engine.microbatch import micro_batch_mean, micro_batch_sizes, micro_batches_of
from poros_lightning.errors import NonFiniteLossError, PorosConfigError, PorosError, ResumeMismatchError
from poros_lightning.training.chunked_loss import (
    check_chunk_tokens,
    chunked_causal_lm_eval,
    final_logit_softcap,
    peft_chunked_loss,
)
from poros_lightning.training.models import load_base_model

__all__ = ["IGNORE_INDEX", "LoRALightningModule", "causal_lm_loss"]

IGNORE_INDEX = -100
"""Label value that carries no loss (prompt tokens, padding); the Hugging Face convention."""

Batch = dict[str, torch.Tensor]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the positions whose label is not ``-100``.

    ``labels`` are aligned with the inputs (not shifted): position ``t`` of ``logits`` predicts
    ``labels[t + 1]``. The loss is computed in float32 whatever the logits' dtype. A batch without any
    labelled position gives a zero loss that still depends on ``logits`` (so backward works) instead of NaN.

    Args:
        logits: ``[B, T, V]`` model outputs.
        labels: ``[B, T]`` token ids, ``-100`` where no loss is taken.
    """
    shift_logits = logits[:, :-1, :].float().reshape(-1, logits.shape[-1])
    shift_labels = labels[:, 1:].reshape(-1).to(shift_logits.device)
    total = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    count = (shift_labels != IGNORE_INDEX).sum()
    return total / count.clamp_min(1)


def _check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not ok or not math.isfinite(value):
        raise PorosConfigError(
            f"{name} must be {'>= 0' if allow_zero else '> 0'} and finite, got {value!r}.",
            f"Set model.{name} to a valid value in the config (or --model.{name} on the command line).",
        )


class LoRALightningModule(L.LightningModule):
    """Fine-tune a LoRA adapter on a frozen (by default NF4-quantized) Hugging Face causal LM.

    Args:
        model: a local directory, a hub id, or ``"smollm2"`` (bundled SmolLM2-135M-Instruct).
        model_config: a Hugging Face config dict with ``model_type`` (random init; tests and benchmarks).
        lora_r: adapter rank.
        lora_alpha: LoRA scaling numerator (the update is scaled by ``lora_alpha / lora_r``).
        lora_dropout: dropout on the adapter input.
        target_modules: module names to adapt; by default the architecture registry's ``lora_targets``
            (every linear layer of the decoder).
        quantization: base quantization, one of ``"nf4-dq"``, ``"nf4"``, ``"fp4"``, ``"none"``.
        compute_dtype: dtype of the base's unquantized tensors and 4-bit matmuls.
        attn_implementation: ``"eager"`` (deterministic) or ``"sdpa"``.
        learning_rate: AdamW peak learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warmup from ``learning_rate / warmup_steps`` to ``learning_rate`` (0: none).
        betas: AdamW betas.
        seed: when set, ``seed_everything(seed)`` runs first, so base init (for ``model_config``) and LoRA init
            are reproducible without an outer seed.
        allow_unlisted_arch: build a ``model_type`` the architecture registry does not list.
        compile_layers: ``torch.compile`` each decoder layer (see :func:`poros_lightning.training.compiling.compile_layers`;
            streamed and resident runs stay bit-identical; the first steps include compilation).
        loss_chunk_tokens: compute the LM head and the loss this many token positions at a time (the backward
            recomputes each chunk's logits), so the ``[B, T, vocabulary]`` fp32 logits never exist: about
            ``10 x chunk x vocabulary`` bytes instead of ``10 x tokens x vocabulary``, for one more head forward
            per step. Streamed and resident runs stay bit-identical; against the unchunked loss the sums run in
            another order (last-bit differences, see :mod:`poros_lightning.training.chunked_loss`). ``None``: unchunked.
    """

    def __init__(
        self,
        model: str | None = None,
        model_config: dict[str, Any] | None = None,
        lora_r: int = 16,
        lora_alpha: float = 32,
        lora_dropout: float = 0.05,
        target_modules: list[str] | None = None,
        quantization: str = "nf4-dq",
        compute_dtype: str = "bfloat16",
        attn_implementation: str = "eager",
        learning_rate: float = 2e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        betas: tuple[float, float] = (0.9, 0.999),
        seed: int | None = None,
        allow_unlisted_arch: bool = False,
        compile_layers: bool = False,
        loss_chunk_tokens: int | None = None,
    ) -> None:
        super().__init__()
        if seed is not None:
            L.seed_everything(seed, verbose=False)
        # `seed` only matters before the weights exist; keeping it out of hparams also avoids a clash with the
        # datamodule's own `seed` when Lightning merges both into the logger's hyperparameters.
        self.save_hyperparameters(ignore=["seed"])
        if isinstance(lora_r, bool) or not isinstance(lora_r, int) or lora_r < 1:
            raise PorosConfigError(f"lora_r must be a positive integer, got {lora_r!r}.", "Typical values: 8, 16, 64.")
        _check_positive("lora_alpha", lora_alpha)
        _check_positive("learning_rate", learning_rate)
        _check_positive("weight_decay", weight_decay, allow_zero=True)
        _check_positive("warmup_steps", warmup_steps, allow_zero=True)
        if not 0.0 <= lora_dropout < 1.0:
            raise PorosConfigError(f"lora_dropout must be in [0, 1), got {lora_dropout!r}.", "Typical values: 0.0-0.1.")
        self.loss_chunk_tokens = check_chunk_tokens(loss_chunk_tokens)

        base = load_base_model(
            model,
            model_config,
            quantization=quantization,
            compute_dtype=compute_dtype,
            allow_unlisted_arch=allow_unlisted_arch,
            attn_implementation=attn_implementation,
        )
        self._lm_parts = self._find_lm_parts(base, allow_unlisted_arch) if loss_chunk_tokens else None
        self.model = self._apply_lora(base, target_modules, allow_unlisted_arch)
        self.model.train()
        if compile_layers:
            from poros_lightning.training.compiling import compile_layers as compile_each_layer

            compile_each_layer(self.model)
        # Checkpoints hold the adapter only; the frozen base is rebuilt from `model` / `model_config`.
        self.strict_loading = False

        vocab = int(base.config.vocab_size)
        self.val_loss = MeanMetric()
        self.val_token_acc = MulticlassAccuracy(num_classes=vocab, ignore_index=IGNORE_INDEX, average="micro")
        self._step_start: float | None = None

    def _apply_lora(self, base: torch.nn.Module, target_modules: Sequence[str] | None, allow_unlisted: bool) -> Any:
        from peft import LoraConfig, get_peft_model

        from poros_lightning.arch import get_arch

        hp = self.hparams
        if target_modules:
            targets: list[str] | str = list(target_modules)
        else:
            spec = get_arch(base.config.model_type, allow_unlisted=allow_unlisted)
            # A guessed (unlisted) layout may name modules the model lacks: let PEFT find every linear layer.
            targets = "all-linear" if getattr(spec, "guessed", False) else list(spec.lora_targets)
        config = LoraConfig(
            task_type="CAUSAL_LM",
            r=hp.lora_r,
            lora_alpha=hp.lora_alpha,
            lora_dropout=hp.lora_dropout,
            target_modules=targets,
        )
        try:
            return get_peft_model(base, config)
        except ValueError as err:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in base.named_modules() if hasattr(m, "in_features")})
            raise PorosConfigError(
                f"LoRA target_modules {targets} do not match the model: {err}",
                f"Use names of its linear layers, e.g. {linear}, or leave target_modules unset.",
            ) from err

    @staticmethod
    def _find_lm_parts(base: torch.nn.Module, allow_unlisted: bool) -> tuple[str, str, float | None]:
        """Where the decoder body and the LM head are, and the logit soft cap the model's forward applies."""
        from poros_lightning.arch import arch_for_model

        spec = arch_for_model(base, allow_unlisted=allow_unlisted)
        return spec.body, spec.head, final_logit_softcap(base.config, spec)

    def _hidden(self, batch: Batch) -> torch.Tensor:
        """The final hidden states ``[B, T, H]``: the body the model's forward calls, without the head."""
        from poros_lightning.arch import resolve

        assert self._lm_parts is not None
        body = resolve(self.model.get_base_model(), self._lm_parts[0])
        out = body(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False)
        return out.last_hidden_state

    def _lm_head(self) -> tuple[torch.nn.Module, Any]:
        """The head module and the engine's host-memory keeper of its weight (``None`` when it is resident)."""
        from poros_lightning.api import engine_of
        from poros_lightning.arch import resolve

        assert self._lm_parts is not None
        head = resolve(self.model.get_base_model(), self._lm_parts[1])
        host = getattr(engine_of(self.model), "host_head", None)
        return head, host if host is not None and host.module is head else None

    def _chunked_loss(self, batch: Batch) -> torch.Tensor:
        """The training loss with the head and the loss in chunks (one loss per block-major micro-batch)."""
        assert self._lm_parts is not None
        head, _ = self._lm_head()
        return peft_chunked_loss(
            self.model,
            self._hidden(batch),
            batch["labels"],
            head,
            self.loss_chunk_tokens,
            softcap=self._lm_parts[2],
            ignore_index=IGNORE_INDEX,
        )

    @override
    def on_fit_start(self) -> None:
        if not self.loss_chunk_tokens or micro_batches_of(self.model) == 1:
            return
        head, _ = self._lm_head()
        trained = [n for n, p in head.named_parameters() if p.requires_grad]
        if trained:
            raise PorosConfigError(
                f"loss_chunk_tokens with block-major micro-batches needs a frozen LM head; this one trains "
                f"{trained[:2]}, whose per-micro-batch gradients would be summed in autograd's order.",
                "Leave the LM head out of target_modules, or use micro_batches=1 (Trainer(accumulate_grad_batches=k) "
                "is exact) or loss_chunk_tokens=None.",
            )

    @override
    def setup(self, stage: str) -> None:
        # Catch a tokenizer/model mismatch before the first step instead of as an index error inside it.
        datamodule = getattr(self.trainer, "datamodule", None)
        seq_len = getattr(datamodule, "seq_len", None)
        context = getattr(self.model.get_base_model().config, "max_position_embeddings", None)
        if isinstance(seq_len, int) and isinstance(context, int) and seq_len > context:
            raise PorosConfigError(
                f"data.seq_len={seq_len} exceeds the model's context (max_position_embeddings={context}).",
                f"Set data.seq_len to at most {context}.",
            )
        tokenizer = getattr(datamodule, "tokenizer", None)
        vocab = self.model.get_input_embeddings().num_embeddings
        if tokenizer is not None and len(tokenizer) > vocab:
            raise PorosConfigError(
                f"The data's tokenizer has {len(tokenizer)} tokens but the model's embedding only {vocab}.",
                "Use the tokenizer that belongs to the model (data.tokenizer), or a model_config with a larger "
                "vocab_size.",
            )

    @property
    def adapter_names(self) -> list[str]:
        """Qualified names (as in ``state_dict``) of the trainable adapter tensors."""
        return [name for name, p in self.named_parameters() if p.requires_grad]

    @override
    def forward(self, batch: Batch) -> torch.Tensor:
        """Return the ``[B, T, V]`` logits for a batch dict with ``input_ids`` and optional ``attention_mask``."""
        # No KV cache in training or validation: it would only hold extra references to every layer's K/V.
        return self.model(
            input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False
        ).logits

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        k = micro_batches_of(self.model)
        if self.loss_chunk_tokens:  # the head and the loss in token chunks (per micro-batch when k > 1)
            loss = self._chunked_loss(batch)
        elif k > 1:  # block-major micro-batches (PorosStrategy(micro_batches=k)): one loss per micro-batch
            sizes = micro_batch_sizes(self.model, batch["input_ids"].shape[0])
            loss, _ = micro_batch_mean(causal_lm_loss, k, self(batch), batch["labels"], sizes=sizes)
        else:
            loss = causal_lm_loss(self(batch), batch["labels"])
        self.log(
            "train/loss", loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=batch["input_ids"].shape[0]
        )
        if self._trainer is not None and self.trainer.optimizers:
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=True, on_epoch=False)
        return loss

    @override
    def on_train_batch_start(self, batch: Batch, batch_idx: int) -> None:
        self._step_start = time.perf_counter()

    @override
    def on_train_batch_end(self, outputs: Any, batch: Batch, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None and not bool(torch.isfinite(loss)):  # also waits for the step's device work
            raise NonFiniteLossError(
                f"The training loss is {loss.item()} at step {self.global_step} (batch {batch_idx}).",
                "Lower model.learning_rate, add model.warmup_steps, or check the data for empty or corrupt records.",
            )
        if self._step_start is None:
            return
        elapsed = time.perf_counter() - self._step_start
        mask = batch.get("attention_mask")
        tokens = int(mask.sum()) if mask is not None else batch["input_ids"].numel()
        self.log("train/tokens_per_s", tokens / max(elapsed, 1e-9), on_step=True, on_epoch=False, prog_bar=True)

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        if self.loss_chunk_tokens:
            head, host = self._lm_head()
            loss, predicted, targets = chunked_causal_lm_eval(
                self._hidden(batch),
                batch["labels"],
                head,
                self.loss_chunk_tokens,
                softcap=self._lm_parts[2],
                host_head=host,
                ignore_index=IGNORE_INDEX,
            )
            count = (targets != IGNORE_INDEX).sum()
            if int(count) > 0:
                self.val_loss.update(loss, weight=count)
                self.val_token_acc.update(predicted, targets)
            return loss
        logits = self(batch)
        labels = batch["labels"]
        loss = causal_lm_loss(logits, labels)
        count = (labels[:, 1:] != IGNORE_INDEX).sum()
        if int(count) > 0:
            self.val_loss.update(loss, weight=count)
            self.val_token_acc.update(logits[:, :-1].argmax(-1).reshape(-1), labels[:, 1:].reshape(-1))
        return loss

    @override
    def on_validation_epoch_end(self) -> None:
        if self.val_loss.update_count == 0:
            rank_zero_warn("No labelled token in the validation data: val/loss is not logged.")
            return
        loss = self.val_loss.compute()
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/ppl", torch.exp(loss))
        self.log("val/token_acc", self.val_token_acc.compute())
        # trainer.validate runs under inference_mode, fit's validation under no_grad: states re-created inside
        # inference mode would be inference tensors, which a later in-place update outside it rejects.
        with torch.inference_mode(False):
            self.val_loss.reset()
            self.val_token_acc.reset()

    @override
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=hp.learning_rate, betas=tuple(hp.betas), weight_decay=hp.weight_decay)
        if not hp.warmup_steps:
            return optimizer
        warmup = int(hp.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        adapter = set(self.adapter_names)
        state = checkpoint.get("state_dict", {})
        kept = {k: v for k, v in state.items() if k in adapter}
        if adapter and not kept:
            raise PorosError(
                f"The checkpoint's state_dict holds none of the {len(adapter)} adapter tensors "
                f"(first key: {next(iter(state), None)!r}, first adapter tensor: {min(adapter)!r}).",
                "The strategy must return state_dict keys named as LoRALightningModule.named_parameters() names them.",
            )
        checkpoint["state_dict"] = kept

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        adapter = set(self.adapter_names)
        keys = set(checkpoint.get("state_dict", {}))
        unknown, missing = sorted(keys - adapter), sorted(adapter - keys)
        if unknown or missing:
            raise ResumeMismatchError(
                f"The checkpoint does not match this model's adapter: {len(unknown)} unknown tensors "
                f"(e.g. {unknown[:2]}), {len(missing)} missing (e.g. {missing[:2]}).",
                "Resume with the same model, lora_r and target_modules the checkpoint was trained with "
                "(see the hyper_parameters stored in the checkpoint).",
            )

    @override
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load adapter tensors; the frozen base's tensors are never expected (checkpoints do not hold them).

        With ``strict=True`` a missing adapter tensor or an unknown key raises, as in ``nn.Module``.
        """
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        adapter = set(self.adapter_names)
        missing = [k for k in result.missing_keys if k in adapter]
        if strict and (missing or result.unexpected_keys):
            raise ResumeMismatchError(
                f"Adapter state mismatch: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}.",
                "Load a state dict saved from a module with the same model, lora_r and target_modules.",
            )
        return _IncompatibleKeys(missing, result.unexpected_keys)

    def save_adapter(self, path: str) -> None:
        """Write the adapter as a standard PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``)."""
        from poros_lightning.training.adapter import save_adapter

        save_adapter(self.model, path)  # PEFT directory + poros_training.json (how the base was quantized)
