"""DSV41Model: the engine's public API (from_pretrained, chat_session, reconfigure, memory_report) over a HF causal LM
and the DS-V4.1 cache.

    model = DSV41Model.from_pretrained(DSV41Config(...))
    model.warmup(sample_inputs=["你好", "请介绍一下你自己"])
    for event in model.chat_session().send("Summarise this", documents=["paper.pdf"]): ...
    model.print_memory_usage()

Why this file is long: DSV41Model is the one object the app, the CLI and the benchmarks hold (loading, sessions,
the figures shown before a turn, saved caches, memory, reconfigure); what does not need its state lives in
loader.py, session.py, memory.py and the cache package.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import psutil
import torch

from . import chat_template, kernels, loader
from . import memory as memory_mod
from .cache import CacheSettings, DSV41Cache
from .cache.attention import pick_backend
from .cache.budget import budget_for
from .cache.kv_cache import kv_bytes_per_token
from .config import CACHE_KNOBS, DSV41Config
from .documents import Document, format_for_prompt
from .errors import ConfigError, ContextOverflowError, ModelLoadError
from .events import ContextUsage, Done, Event, TokenText
from .info import LoadInfo, ReconfigureResult
from .memory import MemoryReport
from .models import adapter
from .sampling import GenerationSettings
from .session import ChatSession

log = logging.getLogger(__name__)

AUTO_HEADROOM_FRACTION = 0.5  # of free memory a document turn may fill before compacting mid-stream


class DSV41Model:
    def __init__(self, config: DSV41Config, hf_model, tokenizer, info: LoadInfo, baseline_rss: int):
        self.config = config
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.info = info
        self.device = next(hf_model.parameters()).device
        self.dtype = adapter.compute_dtype(hf_model)  # activations and KV; weights may be held as bf16
        self._baseline_rss = baseline_rss
        self.weights_bytes = memory_mod.module_bytes(hf_model)
        self.num_layers, self.kv_heads, self.head_dim = adapter.kv_geometry(hf_model)
        # every device the weights and the cache use (several GPUs when device_map="auto" spread the layers)
        self._layer_devices = tuple(adapter.layer_devices(hf_model))
        self.devices = tuple(dict.fromkeys([str(self.device)] + [str(d) for d in self._layer_devices]))
        memory_mod.begin_turn(self.devices)  # the load's own peak is not a turn's working memory
        self.eos_ids = _eos_ids(hf_model, tokenizer)
        self._sessions: weakref.WeakSet[ChatSession] = weakref.WeakSet()
        self._active: ChatSession | None = None
        self._pending: list[tuple[ChatSession | None, dict]] = []  # changes asked for during a reply, in order: the
        # chat each is for (None: every chat) and its knobs
        self._lock = threading.Lock()
        self.generation_defaults = GenerationSettings()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, config: DSV41Config | None = None, *, progress=None, **overrides) -> DSV41Model:
        """Load the model named by config.model_path. `progress(message, fraction)` gets loading steps."""
        config = (config or DSV41Config()).replace(**overrides) if overrides else (config or DSV41Config())
        baseline_rss = psutil.Process().memory_info().rss
        started = time.perf_counter()
        # a first start's conversion is the first 60 % of the bar, the load the rest (it never runs backwards)
        convert = (lambda message, fraction: progress(message, 0.6 * fraction)) if progress else None
        device = loader.pick_device(config.device_map)
        dtype = loader.pick_dtype(config.dtype, device)
        # INT8 weights on the CPU: our per-row int8 and kernels (engine.kernels), ~3x faster than
        # bitsandbytes' CPU path; bitsandbytes elsewhere, or where our kernels cannot be built
        own_int8 = config.weight_quant == "int8" and device == "cpu" and kernels.load() is not None
        # a GGUF's weights are read from the file itself (engine.models.gguf_load), its conversion holds the
        # config and tokenizer only: on the CPU, and on one GPU with full-precision weights (bitsandbytes and
        # accelerate's spreading over several GPUs load through transformers, from a float32 conversion)
        spread = config.device_map == "auto" and device.startswith("cuda") and torch.cuda.device_count() > 1
        straight = (device == "cpu" and (config.weight_quant == "none" or own_int8)) or \
            (device.startswith("cuda") and config.weight_quant == "none" and not spread)
        source = loader.resolve_source(config.model_path, progress=convert, weights=not straight)
        resolved = time.perf_counter()
        if progress:
            progress(f"Loading {source.display_name}…", 0.65)
        load = dict(dtype=dtype, device=device, device_map=config.device_map,
                    trust_remote_code=config.trust_remote_code, allow_pickled_weights=config.allow_pickled_weights)
        # float32 compute; weights held as bf16 where that is exact, or (dtype "auto") where the checkpoint was
        # quantized coarser than bf16 anyway (adapter.pack_weights). In that second case (the default model)
        # prefill runs in bf16 too (attention, and matrix products where the CPU has bf16 dot products; norms, the
        # residual and every decode step compute in float32) and the KV cache holds bf16 (kv_dtype): 2.6x faster
        # prefill with AMX, half the cache, perplexity within +-0.2 % (adapter.set_prefill_bf16)
        # A GGUF's matrices are held in their own block formats where our kernels multiply them (the checkpoint's
        # exact values, its bytes read per token; adapter.hold_gguf), the others as above. DSV41_GGUF_BLOCKS=0
        # converts every matrix as before (for comparison).
        rounded_source = config.dtype == "auto" and loader.source_is_quantized(source.path)
        blocks = rounded_source and not own_int8 and os.environ.get("DSV41_GGUF_BLOCKS", "1") != "0"
        install = dict(pack_rounding=rounded_source, pack_format="int8" if own_int8 else "bf16",
                       prefill_bf16=rounded_source, graphs=config.decode_graph)
        hf_model = None
        try:
            if straight and source.gguf is not None:
                hf_model, tokenizer, held = loader.load_gguf(source.path, source.gguf, dtype=dtype, hold=blocks,
                                                             device=device)
                try:
                    adapter.install(hf_model, **install, gguf=held if blocks else None)
                except ValueError as exc:  # a layout our decoder does not hold: load the float conversion
                    log.warning("%s: loading its float32 conversion instead (%s)", source.gguf.name, exc)
                    hf_model = None
                    source = loader.resolve_source(config.model_path, progress=convert)
            if hf_model is None:
                hf_model, tokenizer = loader.load_model(source.path, weight_quant="none" if own_int8 else
                                                        config.weight_quant, **load)
                adapter.install(hf_model, **install, gguf=source.gguf if blocks else None)
        except ModelLoadError as exc:
            if exc.reason == "corrupt" and source.kind in ("default", "gguf"):
                loader.discard_conversion(source.path)  # converted before damage was checked: convert again
            raise
        if own_int8 and adapter.packed_format(hf_model) != "int8":  # a layout our decoder does not cover
            del hf_model
            source = loader.resolve_source(config.model_path, progress=convert)  # bitsandbytes reads the floats
            hf_model, tokenizer = loader.load_model(source.path, weight_quant="int8", **load)
            adapter.install(hf_model, graphs=config.decode_graph)
        first_device = next(hf_model.parameters()).device
        backend = pick_backend(config.use_flash_attention, first_device, dtype)
        info = LoadInfo(source.kind, source.display_name, str(source.path), resolved - started,
                        time.perf_counter() - resolved, str(first_device),
                        str(dtype).replace("torch.", ""), config.weight_quant, backend,
                        adapter.packed_format(hf_model) or "", adapter.prefill_products_bf16(hf_model),
                        adapter.attention_kernels_line(hf_model, backend, first_device))
        if first_device.type == "cpu":
            memory_mod.return_free_heap()
        if progress:
            progress("Model ready", 1.0)
        return cls(config, hf_model, tokenizer, info, baseline_rss)

    # ------------------------------------------------------------------ derived settings
    @property
    def max_positions(self) -> int:
        return adapter.max_positions(self.hf_model) or self.config.max_seq_len

    @property
    def context_limit(self) -> int:
        """Tokens a conversation may see: max_seq_len, capped by the model's positions unless extrapolating."""
        if self.config.allow_position_extrapolation:
            return self.config.max_seq_len
        return min(self.config.max_seq_len, self.max_positions)

    @property
    def prefill_chunk(self) -> int:
        return self.chunk_for(self.config.prefill_chunk)

    def chunk_for(self, prefill_chunk: int | None) -> int:
        """Tokens a prefill forward reads: `prefill_chunk` (a cache's own setting), or the device's default."""
        if prefill_chunk:
            return prefill_chunk
        # a CPU reads 1024 tokens a forward: the first token of a 4k prompt 22 % sooner than with 512 for the
        # default model's GGUF blocks (one dequantisation per chunk), 4 % for bf16-held weights; an 8k turn's
        # peak +20-50 MiB (2048: +70-140 MiB for 9 % more); a stop waits for the chunk being read
        # (benchmarks/prefill_chunk.py, docs/design.md)
        return 2048 if self.device.type == "cuda" else 1024

    def cache_settings(self) -> CacheSettings:
        return CacheSettings.from_config(self.config)

    def new_cache(self, settings: CacheSettings | None = None) -> DSV41Cache:
        """An empty cache at the model's knobs, or at `settings` (a server request's own)."""
        settings = settings or self.cache_settings()
        initial = max(256, int(self.config.max_seq_len * settings.kv_cache_ratio))
        return DSV41Cache(self.num_layers, self.kv_heads, self.head_dim, self.kv_dtype, self.device, settings,
                          backend=self.info.attention_backend, initial_capacity=initial,
                          prefill_bf16=adapter.prefill_bf16(self.hf_model),
                          layer_devices=self._layer_devices if len(set(self._layer_devices)) > 1 else None)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype the KV cache stores (INT8 KV aside). A model that prefills in bf16 (the default load, see
        adapter.set_prefill_bf16) stores bf16 keys and values: its prefill attention reads them rounded to bf16
        anyway, so storing them so changes no prefill result, halves the cache, and the decode step reads them
        widened to float32. Otherwise the compute dtype."""
        if self.dtype == torch.float32 and adapter.prefill_bf16(self.hf_model):
            return torch.bfloat16
        return self.dtype

    def kv_bytes_per_token(self) -> int:
        """KV bytes per stored token at the current settings."""
        return self._bytes_per_token(self.config.kv_cache_dtype == "int8")

    def _bytes_per_token(self, int8: bool) -> int:
        element_bytes = torch.empty((), dtype=self.kv_dtype).element_size()
        return kv_bytes_per_token(self.num_layers, self.kv_heads, self.head_dim, element_bytes, int8)

    def headroom_tokens(self, cache: DSV41Cache) -> int | None:
        """How many entries a document turn may hold before compacting while it streams in."""
        headroom = cache.settings.prefill_headroom  # the cache's own (a server request may set it for its chat)
        per_token = cache.bytes_per_token()
        if isinstance(headroom, int):
            return headroom
        if isinstance(headroom, float):
            return max(int(headroom * 1024**3 / per_token), 1)
        if self.device.type == "cuda":  # each device holds its own layers' share of every token
            tokens = memory_mod.cuda_headroom_tokens([layer.device for layer in cache.layers], per_token,
                                                     AUTO_HEADROOM_FRACTION)
            if tokens is not None:
                return tokens
        free = self.memory_report(cache).free
        return max(int(free * AUTO_HEADROOM_FRACTION / per_token), 1)

    def generation_settings(self, **overrides) -> GenerationSettings:
        if "stop" in overrides and isinstance(overrides["stop"], str):
            overrides["stop"] = (overrides["stop"],)
        if overrides.get("max_new_tokens") is None:
            overrides.pop("max_new_tokens", None)
        from dataclasses import replace

        return replace(self.generation_defaults, **overrides)

    # ------------------------------------------------------------------ what the GUI shows before a turn
    def count_tokens(self, text: str) -> int:
        """Tokens of `text` as the engine feeds it: as data (template markers in it are plain text)."""
        return chat_template.count_text(self.tokenizer, text) if text else 0

    def count_chat(self, messages: list[dict]) -> int:
        """Tokens of a conversation (`messages` as ChatSession keeps them) rendered with the chat template."""
        if not messages:
            return 0
        return len(chat_template.encode(self.tokenizer, chat_template.render(self.tokenizer, messages, False)))

    def document_tokens(self, document: Document) -> int:
        """Tokens a document takes in the prompt (its header and text, as a turn lays it out)."""
        return self.count_tokens(format_for_prompt(document))

    def stored_kv_bytes(self, tokens_seen: int, **knobs) -> int:
        """KV bytes a cache holds after `tokens_seen` tokens once compacted to its budget, at the current
        settings or with `knobs` changed (validated): the budget's floor (min_entries) and protected window
        included, so a short document at a low ratio is not promised less than the cache keeps."""
        config = self.config.replace(**knobs) if knobs else self.config
        stored = tokens_seen
        if config.kv_cache_ratio < 1.0:
            stored = min(tokens_seen, budget_for(tokens_seen, config.kv_cache_ratio, config.ced_sink_tokens,
                                                 config.ced_recent_tokens, config.min_entries))
        return stored * self._bytes_per_token(config.kv_cache_dtype == "int8")

    def context_usage(self, session: ChatSession | None, history: list[dict], prompt: str = "",
                      documents=(), system_prompt: str | None = None) -> ContextUsage:
        """What a conversation with `history` (user/assistant messages) holds, plus a pending prompt and
        documents. Where `session` holds exactly that history, its cache's count is used; otherwise the
        history is counted as the template renders it, under `system_prompt` when that is not the session's."""
        if session is not None and (system_prompt is None or (session.system_prompt or "") == system_prompt):
            system = [m for m in session.messages if m.get("role") == "system"]
            system_tokens = session.system_tokens
            chat = system + history
            if session.messages == chat and session.cache.seen:
                history_tokens = max(session.cache.seen - system_tokens, 0)
                chat = None
        else:
            system_tokens = chat_template.count_system(self.tokenizer, system_prompt)
            chat = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + history
        if chat is not None:  # the history as the template renders it after what the system part counted
            history_tokens = max(self.count_chat(chat) - system_tokens, 0) if history else 0
        return ContextUsage(system_tokens, history_tokens, sum(self.document_tokens(d) for d in documents),
                            self.count_tokens(prompt), self.context_limit)

    # ------------------------------------------------------------------ saved conversation caches
    @property
    def conversation_store(self):
        """Where chats' caches are saved after each turn (engine.conversation_store); None when
        conversation_cache_mb is 0."""
        from .conversation_store import ConversationStore
        from .paths import conversations_dir

        mb = self.config.conversation_cache_mb
        if not mb:
            return None
        store, folder = getattr(self, "_store", None), conversations_dir()
        if store is None or store.cap_bytes != mb * 2**20 or store.folder != folder:
            store = self._store = ConversationStore(folder, mb * 2**20)
        return store

    @property
    def state_key(self) -> str:
        """This model's identity for saved caches: its folder and weight files (name, size, time), how it is held
        and computed, and its KV geometry. A state saved by any other model never matches."""
        key = getattr(self, "_state_key", None)
        if key is None:
            from .conversation_store import key_of

            info = self.info
            folder = Path(info.folder) if info.folder else None
            # a GGUF's folder is named after the file's path, size and time (engine.gguf) and everything in it is
            # made from the file: the float copy of its weights a later load may add (rewriting the folder)
            # changes nothing this model computes
            made = info.source_kind in ("default", "gguf")
            files = sorted((p.name, p.stat().st_size, 0 if made else p.stat().st_mtime_ns) for p in folder.iterdir()
                           if p.is_file() and not (made and p.name in ("model.safetensors", "dsv41_source.json"))) \
                if folder is not None and folder.is_dir() else []
            key = self._state_key = key_of({
                "folder": str(folder), "files": files, "name": info.display_name, "dtype": str(self.dtype),
                "kv_dtype": str(self.kv_dtype), "weights": [info.weight_quant, info.weight_storage, info.prefill_bf16],
                "geometry": [self.num_layers, self.kv_heads, self.head_dim], "device": self.device.type})
        return key

    @staticmethod
    def settings_key(settings: CacheSettings) -> str:
        """The cache settings a saved state must match: those that shape what the cache holds. Knobs that apply
        live (the decay, how often it compacts, CSA2's top-k, the RAM cap, the prefill chunk and headroom, the
        store's own size) change nothing a saved state holds, so a state made under other values of them is restored
        and goes on under the current ones, as a live change would (with them in the key, moving the top-k made
        every saved chat re-read its whole document)."""
        from .config import KNOBS, LIVE
        from .conversation_store import key_of

        return key_of({k: v for k, v in dataclasses.asdict(settings).items() if KNOBS[k].applies != LIVE})

    # ------------------------------------------------------------------ sessions and one-shot generation
    def chat_session(self, system_prompt: str | None = None) -> ChatSession:
        session = ChatSession(self, system_prompt)
        self._sessions.add(session)
        self._active = session
        return session

    def stream(self, prompt: str, *, documents=(), system_prompt: str | None = None, cancel=None,
               **settings) -> Iterator[Event]:
        """One-shot streamed generation in a fresh session."""
        session = self.chat_session(system_prompt)
        return session.send(prompt, documents, cancel=cancel, **settings)

    def generate(self, prompt: str, *, documents=(), system_prompt: str | None = None, **settings) -> str:
        """One-shot generation; returns the reply text."""
        text = ""
        for event in self.stream(prompt, documents=documents, system_prompt=system_prompt, **settings):
            if isinstance(event, Done):
                text = event.text
        return text

    def complete(self, text: str, *, cancel=None, knobs: dict | None = None, **settings) -> Iterator[Event]:
        """A raw continuation of `text` (no chat template; its markers are plain text) in a cache of its own (at
        the model's cache knobs, `knobs` over them): the server's /v1/completions. Raises ContextOverflowError
        before any work when it cannot fit."""
        from .generate import TurnPlan, run_turn

        ids = chat_template.encode_text(self.tokenizer, text)
        if len(ids) + 1 > self.context_limit:
            raise ContextOverflowError(len(ids) + 1, self.context_limit, {"prompt": len(ids)},
                                       max_positions=self.max_positions)
        generation = self.generation_settings(**settings)
        cache = self.new_cache(self.cache_settings().replace(**knobs) if knobs else None)
        plan = TurnPlan(ids, min(len(ids), 64), self.chunk_for(cache.settings.prefill_chunk), None, self.context_limit)
        return run_turn(self.hf_model, self.tokenizer, cache, plan, generation, cancel=cancel,
                        eos_ids=self.eos_ids)

    def warmup(self, sample_inputs=("你好", "请介绍一下你自己"), max_new_tokens: int = 4) -> list[float]:
        """Run short generations so kernels and allocators are initialised; returns each TTFT in seconds."""
        ttfts = []
        for text in sample_inputs:
            session = ChatSession(self)
            for event in session.send(text, max_new_tokens=max_new_tokens, greedy=True):
                if isinstance(event, Done) and event.stats:
                    ttfts.append(event.stats.ttft_s)
        return ttfts

    def memory_report(self, cache: DSV41Cache | None = None, *, last_chat: bool = True) -> MemoryReport:
        """The memory figures with `cache`'s KV; without one, the last chat's (`last_chat`), or no chat's."""
        if cache is None and last_chat and self._active is not None:
            cache = self._active.cache
        kv = cache.stored_kv_bytes() if cache else 0
        kv_full = cache.uncompressed_bytes() if cache else 0
        report = memory_mod.measure(
            str(self.device), self.weights_bytes, kv, kv_full, baseline_rss=self._baseline_rss,
            tokens_seen=cache.seen if cache else 0, kv_stored_tokens=cache.stored if cache else 0,
            kv_reserved=cache.nbytes() if cache else 0, kv_cold=cache.cold_bytes("ram") if cache else 0,
            kv_cold_disk=cache.cold_bytes("disk") if cache else 0,
            recall_s=cache.recall_seconds if cache is not None and cache.recalled else None,
            saved_caches=store.total_bytes() if (store := self.conversation_store) is not None else 0,
            devices=self.devices)
        if cache is None:
            return report
        return dataclasses.replace(report, kv_target_ratio=cache.settings.kv_cache_ratio,
                                   kv_ratio_reason=cache.ratio_reason(report.compression_ratio))

    def print_memory_usage(self, cache: DSV41Cache | None = None) -> MemoryReport:
        report = self.memory_report(cache)
        print(report.format_text())
        return report

    # ------------------------------------------------------------------ reconfigure
    def reconfigure(self, session: ChatSession | None = None, progress=None, **knobs) -> ReconfigureResult:
        """Change cache knobs between turns; they become the model's knobs, which new chats start with. With
        `session`, that chat's cache alone takes them (every chat keeps the knobs it was last given: the app keeps
        knobs per chat, and opening a chat applies its own without touching the others); without, every live
        chat's cache does. During a reply the change is deferred to the end of the turn."""
        bad = [k for k in knobs if k not in CACHE_KNOBS]
        if bad:
            raise ConfigError(bad[0], knobs[bad[0]], "a cache knob (" + ", ".join(sorted(CACHE_KNOBS)) + "); "
                              "other fields need a reload with DSV41Model.from_pretrained")
        # a chat's change is made to its own knobs (another chat's change, which the model's took, is not in it)
        base = self.config if session is None else self.config.replace(**dataclasses.asdict(session.cache.settings))
        new_config = base.replace(**knobs)  # validates
        if any(s.busy for s in self._sessions):
            self._pending.append((session, dict(knobs)))
            return ReconfigureResult("deferred", None, None)
        targets = [session] if session is not None else list(self._sessions)
        settings = CacheSettings.from_config(new_config)
        if new_config == self.config and all(t.cache.settings == settings for t in targets):
            return ReconfigureResult("unchanged", None, None)
        self.config = new_config
        shown = session or self._active
        before = self.memory_report(shown.cache) if shown else None
        action = "unchanged" if session is not None else "compacted"
        for live in targets:
            if live.cache.settings == settings:
                continue
            done = live.apply_settings(settings, progress if live is shown else None)
            if live is shown:
                action = done
        after = self.memory_report(shown.cache) if shown else None
        return ReconfigureResult(action, before, after)

    @property
    def pending_knobs(self) -> dict | None:
        """The knobs of the changes deferred until the running reply ends (the later over the earlier)."""
        merged = {k: v for _, knobs in self._pending for k, v in knobs.items()}
        return merged or None

    def turn_finished(self, session: ChatSession) -> None:
        """Called by a session when its turn is over: knob changes asked for during it are applied now."""
        self._active = session
        if self._pending and not any(s.busy for s in self._sessions):
            changes, self._pending = self._pending, []
            for chat, knobs in changes:  # each to the chat it was asked for, in the order asked
                self.reconfigure(chat, **knobs)


def collect_text(events) -> str:
    """Join the TokenText deltas of an event stream."""
    return "".join(e.text for e in events if isinstance(e, TokenText))


def _eos_ids(hf_model, tokenizer) -> frozenset[int]:
    ids = set()
    for source in (getattr(hf_model, "generation_config", None), hf_model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    for token in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return frozenset(ids)
