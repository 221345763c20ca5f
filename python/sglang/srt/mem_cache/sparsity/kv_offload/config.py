"""Configuration and flag validation for ``--enable-kv-offload``.

Upstream's ``check_server_args`` imports this module and calls :func:`validate_server_args` only when
the flag (or ``--kv-offload-config``) is given, so the default path never imports this package.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from typing import Any, Dict, Optional, Union

from sglang.srt.configs.model_config import (
    get_dsa_index_kpool,
    get_dsa_index_topk,
    is_deepseek_dsa,
)
from sglang.srt.utils.common import ceil_align

logger = logging.getLogger(__name__)

PAGE_SIZE = 64
"""DSA's KV page size on CUDA; host allocation and sparse slot grants are aligned to it."""
DSA_BACKEND_NAMES = ("dsa", "nsa")
"""The DSA attention backend and its deprecated name."""
MAX_SLOTS_PER_REQ = 32767
"""The GPU LRU keeps each request's slot order as int16."""

# Decode attention kernels that read flat token-slot indices into an arbitrary KV tensor, by the KV
# cache dtype they accept. trtllm/tilelang/aiter transform top-k themselves or run on other hardware.
SUPPORTED_DECODE_BACKENDS = {
    "fp8_e4m3": ("flashmla_kv",),
    "bfloat16": ("fa3", "flashmla_sparse"),
}
# Prefill backends that read an fp8 cache through a bf16 copy dequantised by logical token (DSA's
# ragged top-k: a chunked prompt's earlier chunks), where kv offload keeps the KV in physical rows
# (flashmla_auto picks flashmla_sparse for some batches on Blackwell).
FP8_RAGGED_PREFILL_BACKENDS = ("flashmla_sparse", "triton_sparse_mla", "flashmla_auto")


class KVOffloadConfigError(ValueError):
    """A rejected ``--enable-kv-offload`` setting; the message names the flag and the fix."""


@dataclasses.dataclass(frozen=True)
class KVOffloadConfig:
    """Settings parsed from ``--kv-offload-config``.

    Attributes:
        sparse_slots_per_req: GPU KV rows (tokens) a request may hold per layer. A request whose
            prompt and ``max_new_tokens`` fit in them stays on the GPU whole (it never loads from
            the host); a longer one holds this many sparse slots. Must be a multiple of 64 and at
            least the model's ``index_topk``. Rows come from the GPU arena that the index keys of
            every token share (sized by upstream's ``--mem-fraction-static``), as requests need them.
        host_pool_size_gb: pinned host pool size in GB; 0 means use ``host_pool_ratio``.
        host_pool_ratio: host pool tokens as a multiple of the device logical pool tokens.
        pin_host_memory: register the host pool with CUDA (needed for zero-copy loads).
        pd_direct_to_host: PD decode only: the prefill side writes the prompt KV pages straight
            into the decode host pool (registered with the transfer engine), so no GPU page stages
            the prompt and no backup copies it; the DSA index state still goes to the GPU.
        status_log_interval: log one line of offload state (requests, promised and free rows,
            backups) every this many decode steps; 0 turns it off. Host-side counters only.
        share_host_pool: under tensor parallelism, keep one host pool per node that the node's TP
            ranks share (shared memory in ``/dev/shm``; the first rank writes backups, all read)
            instead of one identical copy per rank. The host pool size is then per node.
    """

    sparse_slots_per_req: int = 4096
    host_pool_size_gb: float = 0.0
    host_pool_ratio: float = 1.0
    pin_host_memory: bool = True
    pd_direct_to_host: bool = False
    status_log_interval: int = 1000
    share_host_pool: bool = True

    @classmethod
    def from_json(cls, text: Optional[Union[str, Dict[str, Any]]]) -> "KVOffloadConfig":
        """Parse and validate ``--kv-offload-config`` (a JSON object string, or a dict)."""
        if text is None:
            return cls()
        if isinstance(text, str):
            if not text.strip():
                raise KVOffloadConfigError(
                    "--kv-offload-config is empty. Pass a JSON object such as "
                    "'{\"sparse_slots_per_req\": 4096}', or drop the option for the defaults."
                )
            try:
                raw = json.loads(text, object_pairs_hook=_no_duplicate_keys)
            except json.JSONDecodeError as exc:
                raise KVOffloadConfigError(
                    f"--kv-offload-config is not valid JSON ({exc.msg} at position {exc.pos}). "
                    "Pass an object such as '{\"sparse_slots_per_req\": 4096}'."
                ) from None
        else:
            raw = text
        if not isinstance(raw, dict):
            raise KVOffloadConfigError(
                f"--kv-offload-config must be a JSON object, got {type(raw).__name__}. "
                "Pass an object such as '{\"sparse_slots_per_req\": 4096}'."
            )
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if "sparse_pool_slots" in raw:
            raise KVOffloadConfigError(
                "--kv-offload-config: sparse_pool_slots is no longer used: KV rows and index keys "
                "now share the GPU budget, each taking what the running requests need. Drop it "
                "(--mem-fraction-static / --max-total-tokens size the budget)."
            )
        unknown = sorted(set(raw) - set(fields))
        if unknown:
            raise KVOffloadConfigError(
                f"--kv-offload-config has unknown key(s) {unknown}. "
                f"Valid keys: {sorted(fields)}."
            )
        values = {}
        for key, value in raw.items():
            values[key] = _coerce(key, value, fields[key].type)
        if "host_pool_size_gb" in raw and "host_pool_ratio" in raw:
            raise KVOffloadConfigError(
                "--kv-offload-config sets both host_pool_size_gb and host_pool_ratio; "
                "set only one of them."
            )
        config = cls(**values)
        config.check()
        return config

    def check(self, index_topk: Optional[int] = None) -> None:
        """Range checks; ``index_topk`` is the model's top-k when known."""
        _require(
            self.sparse_slots_per_req > 0 and self.sparse_slots_per_req % PAGE_SIZE == 0,
            f"sparse_slots_per_req={self.sparse_slots_per_req} must be a positive multiple of "
            f"{PAGE_SIZE}; use e.g. 4096",
        )
        if index_topk is not None:
            _require(
                self.sparse_slots_per_req >= index_topk,
                f"sparse_slots_per_req={self.sparse_slots_per_req} is smaller than the model's "
                f"index_topk={index_topk}: every selected token needs a slot; set it to at least "
                f"{ceil_align(index_topk, PAGE_SIZE)}",
            )
        _require(
            self.sparse_slots_per_req <= MAX_SLOTS_PER_REQ,
            f"sparse_slots_per_req={self.sparse_slots_per_req} is above {MAX_SLOTS_PER_REQ}, the "
            "most the GPU LRU can order per request (int16); use at most "
            f"{MAX_SLOTS_PER_REQ // PAGE_SIZE * PAGE_SIZE}",
        )
        _require(
            math.isfinite(self.host_pool_size_gb) and self.host_pool_size_gb >= 0,
            f"host_pool_size_gb={self.host_pool_size_gb} must be a finite number >= 0 (0 uses "
            "host_pool_ratio)",
        )
        _require(
            math.isfinite(self.host_pool_ratio) and self.host_pool_ratio >= 1.0,
            f"host_pool_ratio={self.host_pool_ratio} must be >= 1: the host pool holds the full KV "
            "of every logical token on the device",
        )
        _require(
            self.status_log_interval >= 0,
            f"status_log_interval={self.status_log_interval} must be >= 0 (0 turns it off)",
        )


def _no_duplicate_keys(pairs) -> Dict[str, Any]:
    keys = [k for k, _ in pairs]
    duplicated = sorted({k for k in keys if keys.count(k) > 1})
    if duplicated:
        raise KVOffloadConfigError(
            f"--kv-offload-config sets {duplicated} more than once; JSON would keep only the last "
            "value. Set each key once."
        )
    return dict(pairs)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise KVOffloadConfigError(f"--kv-offload-config: {message}.")


def _coerce(key: str, value: Any, type_name: Any) -> Any:
    type_name = getattr(type_name, "__name__", type_name)
    if type_name == "bool":
        if isinstance(value, bool):
            return value
    elif type_name == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif type_name == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    raise KVOffloadConfigError(
        f"--kv-offload-config: {key} must be a JSON {'number' if type_name == 'float' else type_name}"
        f", got {json.dumps(value)}."
    )


def _reject(message: str) -> None:
    raise KVOffloadConfigError(f"--enable-kv-offload: {message}")


SPECULATIVE_ALGORITHMS = ("EAGLE", "NEXTN")


def _check_speculative(cfg) -> None:
    """EAGLE / NEXTN (DeepSeek-V3.2's MTP layer): target verify plans the union of its draft
    tokens' top-k per request (``DSAOffloadAdapter``); other drafts are not wired. A draft tree
    (``--speculative-eagle-topk`` > 1) upstream already refuses with the DSA backend's page size."""
    algorithm = str(cfg.speculative_algorithm).upper()
    if algorithm not in SPECULATIVE_ALGORITHMS:
        _reject(
            f"--speculative-algorithm {cfg.speculative_algorithm} is not supported: kv offload plans "
            "the target verify of EAGLE-style drafts only. Use --speculative-algorithm NEXTN (the "
            "model's MTP layer) or EAGLE."
        )


def _check_direct_to_host(server_args) -> None:
    """``pd_direct_to_host`` needs a PD decode server whose prefill peers write over Mooncake."""
    mode = server_args.disaggregation_mode
    if mode != "decode":
        raise KVOffloadConfigError(
            f"--kv-offload-config: pd_direct_to_host is set but --disaggregation-mode is {mode!r}; "
            "it only changes where a PD decode server receives prompt KV. Use --disaggregation-mode "
            "decode or drop pd_direct_to_host."
        )
    backend = getattr(server_args, "disaggregation_transfer_backend", "mooncake")
    if backend != "mooncake":
        raise KVOffloadConfigError(
            f"--kv-offload-config: pd_direct_to_host needs --disaggregation-transfer-backend "
            f"mooncake (got {backend!r}): only Mooncake registers host memory as a transfer "
            "destination here. Use mooncake or drop pd_direct_to_host."
        )


def validate_server_args(server_args) -> KVOffloadConfig:
    """Reject flag combinations that kv offload does not support; return the parsed config.

    Called from upstream's ``check_server_args`` (after resolution, at HiSparse's slot) when
    ``--enable-kv-offload`` or ``--kv-offload-config`` is given. ``server_args`` holds the flags as
    given; resolved values (model defaults, backends) are read through ``resolved_view``.
    """
    from sglang.srt.arg_groups.overrides import model_config_of, resolved_view

    cfg = resolved_view(server_args)
    if not cfg.enable_kv_offload:
        raise KVOffloadConfigError(
            "--kv-offload-config was given without --enable-kv-offload; add --enable-kv-offload "
            "or drop --kv-offload-config."
        )
    config = KVOffloadConfig.from_json(cfg.kv_offload_config)
    hf_config = model_config_of(server_args).hf_config
    if not is_deepseek_dsa(hf_config):
        arch = (getattr(hf_config, "architectures", None) or ["unknown"])[0]
        _reject(
            f"the model ({arch}) is not a DSA sparse-attention model (no index_topk in its "
            "config). kv offload needs DeepSeek-V3.2-style sparse attention; drop the flag for this "
            "model."
        )
    config.check(index_topk=get_dsa_index_topk(hf_config))
    kpool = get_dsa_index_kpool(hf_config)
    if kpool != 1:
        _reject(
            f"the model pools {kpool} tokens per index key (index_kpool); kv offload lays the index "
            f"buffer, sparse slots and host pages out in pages of {PAGE_SIZE} single tokens. Drop "
            "the flag for this model."
        )

    backends = {
        "--attention-backend": cfg.attention_backend,
        "--prefill-attention-backend": cfg.prefill_attention_backend,
        "--decode-attention-backend": cfg.decode_attention_backend,
    }
    for flag, backend in backends.items():
        if backend is not None and backend not in DSA_BACKEND_NAMES:
            _reject(f"{flag} is {backend!r}; kv offload runs in the DSA backend. Use {flag} dsa.")
    # As given: upstream resolves every DSA model's page size to 64 whatever --page-size says.
    for page_size in (server_args.page_size, cfg.page_size):
        if page_size is not None and page_size != PAGE_SIZE:
            _reject(
                f"--page-size is {page_size}; the DSA index buffer, the sparse slots and the host "
                f"pages are laid out in pages of {PAGE_SIZE} tokens. Use --page-size {PAGE_SIZE} "
                "or leave it unset."
            )

    exclusive = {
        "enable_hisparse": "--enable-hisparse",
        "disaggregation_decode_enable_offload_kvcache": "--disaggregation-decode-enable-offload-kvcache",
        "enable_hierarchical_cache": "--enable-hierarchical-cache",
    }
    for attr, flag in exclusive.items():
        if getattr(cfg, attr, False):
            _reject(
                f"cannot be combined with {flag}: both move decode KV to the host and would own the "
                f"same pool. Drop one of the two."
            )
    speculative = cfg.speculative_algorithm
    if speculative is not None and str(speculative).upper() != "NONE":
        _check_speculative(cfg)
    if not config.pin_host_memory and cfg.device == "cuda":
        _reject(
            "pin_host_memory=false on CUDA: the per-layer loads read the host pool directly from "
            "the GPU (zero-copy), which needs pinned memory. Drop pin_host_memory from "
            "--kv-offload-config."
        )
    if cfg.pp_size > 1:
        _reject(
            f"pipeline parallelism (--pp-size {cfg.pp_size}) is not supported yet: the "
            "pools and the coordinator are built for all layers of one rank. Use --pp-size 1."
        )
    if cfg.enable_two_batch_overlap:
        _reject(
            "two-batch overlap (--enable-two-batch-overlap) is not supported yet: its two "
            "micro-batches would plan into one workspace. Drop --enable-two-batch-overlap."
        )
    unsupported = {
        "enable_mixed_chunk": "--enable-mixed-chunk (a mixed batch would run prefill tokens "
        "through the decode step's sparse slots)",
        "enable_prefill_cp": "--enable-prefill-cp (context-parallel prefill splits a prompt's KV "
        "across ranks)",
        "enable_kv_cache_sharding": "--enable-kv-cache-sharding (sharded KV rows)",
        "enable_unified_memory": "--enable-unified-memory (the split pool sizes GPU memory "
        "itself)",
        "enable_streaming_session": "--enable-streaming-session (a session keeps a request's KV "
        "row for its next turn; offloaded KV is released with the request)",
    }
    for attr, what in unsupported.items():
        if getattr(cfg, attr, False):
            _reject(f"cannot be combined with {what}. Drop that flag.")
    if (getattr(cfg, "dcp_size", 1) or 1) > 1:
        _reject(
            f"decode context parallelism (--dcp-size {cfg.dcp_size}) is not supported: the host "
            "pool and sparse slots hold a request's whole KV on one rank. Use --dcp-size 1."
        )
    threshold = getattr(cfg, "disaggregation_decode_host_receive_threshold", None)
    if threshold is not None and threshold < 1:
        _reject(
            "--disaggregation-decode-host-receive-threshold below 1 routes prompts to upstream's "
            "host receive path, which kv offload does not own. Leave it unset; kv offload's own "
            "pd_direct_to_host writes prompts into its host pool."
        )
    if cfg.disaggregation_mode == "prefill":
        _reject(
            "this is a prefill server (--disaggregation-mode prefill), which never decodes. Put "
            "--enable-kv-offload on the decode server only."
        )
    if config.pd_direct_to_host:
        _check_direct_to_host(cfg)

    kv_dtype = cfg.kv_cache_dtype
    prefill_backend = cfg.dsa_prefill_backend
    fp8_prefill = "flashmla_kv (the default for fp8_e4m3; or leave it unset)"
    if prefill_backend == "flashmla_sparse_q8":
        _reject(
            "--dsa-prefill-backend flashmla_sparse_q8 writes the prompt KV in its own layout, "
            "which the host pool does not hold. Use --dsa-prefill-backend "
            f"{fp8_prefill if kv_dtype == 'fp8_e4m3' else 'flashmla_sparse'}."
        )
    if kv_dtype not in SUPPORTED_DECODE_BACKENDS:
        formats = " or ".join(
            f"{dtype} (with --dsa-decode-backend {' or '.join(backends)})"
            for dtype, backends in SUPPORTED_DECODE_BACKENDS.items()
        )
        _reject(
            f"--kv-cache-dtype {kv_dtype} is not supported: the host pool holds the DSA KV rows "
            f"of fp8_e4m3 (656 B) or bfloat16 (1152 B). Use --kv-cache-dtype {formats}."
        )
    if kv_dtype == "fp8_e4m3" and prefill_backend in FP8_RAGGED_PREFILL_BACKENDS:
        _reject(
            f"--dsa-prefill-backend {prefill_backend} with --kv-cache-dtype fp8_e4m3 reads a "
            "chunked prompt's earlier KV from a copy dequantised by logical token, but kv offload "
            "keeps the KV in physical rows (it would attend to the wrong rows). Use "
            f"--dsa-prefill-backend {fp8_prefill}."
        )
    decode_backend = cfg.dsa_decode_backend
    if decode_backend is not None:
        allowed = SUPPORTED_DECODE_BACKENDS[kv_dtype]
        if decode_backend not in allowed:
            _reject(
                f"--dsa-decode-backend {decode_backend} is not supported with --kv-cache-dtype "
                f"{kv_dtype}: it must read flat sparse-slot indices. Use --dsa-decode-backend "
                f"{' or '.join(allowed)}."
            )
    logger.info("kv offload enabled: %s", config)
    return config
