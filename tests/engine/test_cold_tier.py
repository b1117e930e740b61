"""The cold tier: what a compaction takes out of the hot set is kept and recalled by a later question."""

import pytest
import torch

from engine import kernels
from engine.cache import CacheSettings, DSV41Cache
from engine.cache.cold import ColdLayer
from engine.cache.storage import LayerKV


def _cache(dtype=torch.float32, **knobs):
    settings = CacheSettings(**{"kv_cache_ratio": 0.25, "csa2_topk": 0, "ced_sink_tokens": 2, "ced_recent_tokens": 4,
                                "min_entries": 8, "ced_threshold": 0.0, **knobs})
    return DSV41Cache(2, 2, 8, dtype, "cpu", settings)


def _read(cache, tokens, *, seed, window=0):
    """One prefill forward of `tokens` random keys through the cache's own attend (2 layers)."""
    g = torch.Generator().manual_seed(seed)
    cache.begin_forward(tokens, score_window=window, prefill=True)
    for index in range(cache.num_layers):
        q = torch.randn(1, 4, tokens, 8, generator=g)
        k = torch.randn(1, 2, tokens, 8, generator=g)
        v = torch.randn(1, 2, tokens, 8, generator=g)
        dev = cache.device
        cache.attend(index, q.to(dev, cache.dtype), k.to(dev, cache.dtype), v.to(dev, cache.dtype), 8**-0.5)
    cache.end_forward()


def _entries(layer_or_cold, head=0):
    n = layer_or_cold.length
    keys = layer_or_cold.read_keys()[head, :n]
    return {int(p): keys[i].clone() for i, p in enumerate(layer_or_cold.positions[head, :n])}


@pytest.mark.parametrize("dtype,cold_dtype,exact", [(torch.float32, "auto", True), (torch.bfloat16, "auto", True),
                                                     (torch.float32, "int8", False)])
def test_evicted_entries_are_kept_with_their_positions_and_come_back_unchanged(dtype, cold_dtype, exact):
    cache = _cache(dtype, cold_tier="ram", cold_tier_dtype=cold_dtype)
    _read(cache, 64, seed=0, window=64)
    before = [_entries(layer) for layer in cache.layers]
    cache.compact()
    for layer, cold, was in zip(cache.layers, cache.cold, before, strict=True):
        assert layer.length == cache.budget() == 16 and cold.length == 48
        hot, kept = _entries(layer), _entries(cold)
        assert set(hot) | set(kept) == set(was) and not set(hot) & set(kept)  # nothing lost, nothing twice
        for position, key in kept.items():
            if exact:
                assert torch.equal(key, was[position])
            else:
                assert torch.allclose(key, was[position], atol=was[position].abs().max().item() / 127 + 1e-6)
    # every cold entry recalled at once: the hot set is the whole document again, in position order
    cold = cache.cold[0]
    keys, values, positions, scores = cold.take(torch.arange(cold.length).expand(2, -1))
    layer = cache.layers[0]
    layer.insert(keys, values, positions, scores)
    assert cold.length == 0 and layer.length == 64
    assert torch.equal(layer.positions[:, :64], torch.arange(64, dtype=torch.int32).expand(2, -1))
    got = _entries(layer)
    for position, key in before[0].items():
        assert torch.equal(got[position], key) if exact else torch.allclose(got[position], key, atol=0.05)


def test_a_question_recalls_the_entry_it_needs_within_the_budget_keeping_sinks_and_recent():
    """The entry an earlier compaction evicted is the one the next question's queries point at: with the cold
    tier it is back in the hot set after the question is read; without it, it stays lost."""
    outcomes = {}
    for tier in ("off", "ram"):
        cache = _cache(cold_tier=tier)
        _read(cache, 64, seed=1, window=64)
        layer0 = cache.layers[0]
        for layer in cache.layers:  # what earlier questions found important, decayed since
            layer.scores[:, :64] = 0.1
            layer.scores[:, 30] = 0.0  # position 30 is the least important now: it goes first
        cache.compact()
        assert 30 not in _entries(layer0)
        # the question: every query of every layer points at the evicted key of position 30
        target = {i: (cache.cold[i] if cache.cold else None) for i in range(2)}
        g = torch.Generator().manual_seed(7)
        cache.begin_forward(4, score_window=4, prefill=True, question=True)
        for index in range(2):
            store = target[index]
            if store is not None:
                pos = store.positions[0, : store.length].tolist()
                key = store.read_keys()[:, pos.index(30) if 30 in pos else 0]
            else:
                key = torch.zeros(2, 8)
            q = (key * 40).repeat_interleave(2, dim=0)[None, :, None, :].expand(1, 4, 4, 8).contiguous()
            cache.attend(index, q, torch.randn(1, 2, 4, 8, generator=g), torch.randn(1, 2, 4, 8, generator=g), 8**-0.5)
        cache.end_forward()
        cache.finish_prefill()
        layer = cache.layers[0]
        positions = layer.positions[0, : layer.length].tolist()
        assert layer.length <= cache.budget()
        assert positions == sorted(positions)
        assert positions[:2] == [0, 1] and positions[-4:] == [64, 65, 66, 67]  # sinks and the recent window
        outcomes[tier] = 30 in positions
    assert outcomes == {"off": False, "ram": True}


@pytest.mark.parametrize("reply_recalled", [6, 1000])
def test_a_reply_keeps_the_budget_plus_reply_recalled_of_what_its_question_read(monkeypatch, reply_recalled):
    """A follow-up question reads with everything it recalled; before its reply the hot set goes back to the budget
    plus REPLY_RECALLED entries a head, the question's own tokens kept whatever their rank (more than the recent
    window here), and nothing leaves for good: what the reply does not keep is cold again."""
    from engine.cache import cold, kv_cache

    monkeypatch.setattr(cold, "RECALL_MIN", 40)
    monkeypatch.setattr(kv_cache, "REPLY_RECALLED", reply_recalled)
    cache = _cache(cold_tier="ram")
    _read(cache, 64, seed=2, window=64)
    cache.finish_prefill()
    assert cache.stored == 16 and cache.cold[0].length == 48
    cache.start_prefill(8, 8, None)  # the next turn: a question of 8 tokens, twice the recent window
    g = torch.Generator().manual_seed(3)
    cache.begin_forward(8, score_window=8, prefill=True, question=True)
    for index in range(2):
        cache.attend(index, torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 2, 8, 8, generator=g),
                     torch.randn(1, 2, 8, 8, generator=g), 8**-0.5)
    cache.end_forward()
    assert cache.recalled == 2 * 40 and cache.stored == 16 + 40 + 8  # the question read with all it recalled
    cache.finish_prefill(answer_follows=True)
    budget = cache.budget()
    expected = min(16 + 40 + 8, budget + reply_recalled)
    assert cache.answer_limit == cache.stored == expected
    for layer, store in zip(cache.layers, cache.cold, strict=True):
        hot = layer.positions[:, : layer.length]
        assert layer.length == expected and store.length == 72 - expected  # nothing lost
        assert all(set(range(64, 72)) <= set(row.tolist()) for row in hot)  # the question stays whole
        assert torch.equal(hot, hot.sort(dim=1).values)
    cache.finish_turn()
    assert cache.stored == budget and cache.answer_limit is None
    # a turn without a question (nothing recalled this turn): its reply keeps all it read, whatever the last turn did
    cache.start_prefill(4, 0, None)
    _read(cache, 4, seed=4, window=4)
    cache.finish_prefill(answer_follows=True)
    assert cache.recalled == 0 and cache.stored == cache.answer_limit == budget + 4


def test_with_the_cold_tier_on_and_ratio_one_nothing_changes():
    plain, tiered = _cache(kv_cache_ratio=1.0), _cache(kv_cache_ratio=1.0, cold_tier="ram")
    for cache in (plain, tiered):
        _read(cache, 50, seed=3, window=50)
        cache.finish_prefill()
    assert tiered.cold_bytes() == 0 and tiered.stored == plain.stored == 50
    for a, b in zip(plain.layers, tiered.layers, strict=True):
        assert torch.equal(a.read_keys(), b.read_keys()) and torch.equal(a.scores[:, :50], b.scores[:, :50])


def test_insert_keeps_every_tensor_of_an_int8_layer_in_position_order():
    layer = LayerKV(2, 8, torch.float32, "cpu", int8=True, initial_capacity=8)
    layer.append(torch.randn(2, 6, 8), torch.randn(2, 6, 8), torch.tensor([0, 1, 4, 5, 8, 9]))
    layer.scores[:, :6] = torch.arange(6.0)
    keys, values = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    layer.insert(keys, values, torch.tensor([[2, 6, 7], [3, 6, 7]]), torch.full((2, 3), 9.0))
    assert layer.length == 9 and layer.capacity >= 9
    assert layer.positions[0, :9].tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert layer.positions[1, :9].tolist() == [0, 1, 3, 4, 5, 6, 7, 8, 9]
    assert layer.scores[0, :9].tolist() == [0, 1, 9, 2, 3, 9, 9, 4, 5]
    assert torch.allclose(layer.read_keys()[0, 2], keys[0, 0], atol=keys[0, 0].abs().max().item() / 127 + 1e-6)
    assert torch.all(layer.log_counts[:, :9] == 0)


def test_cold_layer_take_removes_exactly_what_it_returns():
    hot = LayerKV(1, 4, torch.float32, "cpu")
    hot.append(torch.randn(1, 10, 4), torch.randn(1, 10, 4), torch.arange(10))
    cold = ColdLayer(1, 4, torch.float32, "cpu", int8=False)
    cold.add(hot, torch.tensor([[1, 3, 5, 7]]))
    keys, _, positions, _ = cold.take(torch.tensor([[2, 0]]))
    assert positions.tolist() == [[5, 1]] and torch.equal(keys[0, 0], hot.read_keys()[0, 5])
    assert cold.length == 2 and sorted(cold.positions[0, :2].tolist()) == [3, 7]


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("taken", [1, 7, 20, 39, 40])
def test_cold_layer_take_keeps_every_other_entry_whole(int8, taken):
    """Whatever a take removes (per head its own entries, anywhere in the tier, up to all of it), every entry that
    stays keeps its key, value, position, score and scales together, and none is lost or doubled."""
    g = torch.Generator().manual_seed(taken)
    hot = LayerKV(3, 8, torch.float32, "cpu")
    hot.append(torch.randn(3, 40, 8, generator=g), torch.randn(3, 40, 8, generator=g), torch.arange(40) * 3)
    hot.scores[:, :40] = torch.rand(3, 40, generator=g)
    cold = ColdLayer(3, 8, torch.float32, "cpu", int8=int8)
    cold.add(hot, torch.arange(40).expand(3, -1))
    before = [{int(p): (cold.read_keys()[h, i].clone(), cold.read_values()[h, i].clone(), float(cold.scores[h, i]))
               for i, p in enumerate(cold.positions[h, :40])} for h in range(3)]
    index = torch.stack([torch.randperm(40, generator=g)[:taken] for _ in range(3)])
    _, _, positions, _ = cold.take(index)
    assert cold.length == 40 - taken
    for h in range(3):
        stays = {int(p): i for i, p in enumerate(cold.positions[h, : cold.length])}
        assert len(stays) == cold.length and set(stays) == set(before[h]) - set(positions[h].tolist())
        for p, i in stays.items():
            key, value, score = before[h][p]
            assert torch.equal(cold.read_keys()[h, i], key) and torch.equal(cold.read_values()[h, i], value)
            assert float(cold.scores[h, i]) == score


def _no_row_kernels(monkeypatch):
    from engine.kernels import cache_ops as rows

    monkeypatch.setattr(rows, "take_rows", lambda *a, **k: None)
    monkeypatch.setattr(rows, "insert_rows", lambda *a, **k: False)
    monkeypatch.setattr(rows, "recall_move", lambda *a, **k: False)


def _layer_state(layer, names, length):
    return {name: getattr(layer, name)[:, :length].clone() for name in names}


@pytest.mark.skipif(kernels.load() is None, reason=f"CPU kernels: {kernels.unavailable_reason()}")
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("taken", [1, 13, 40])
@pytest.mark.parametrize("sorted_index", [False, True])
def test_the_row_kernels_move_a_recall_exactly_as_torch_does(monkeypatch, int8, taken, sorted_index):
    """A take out of the cold tier and the insert into the hot set through one C call each (engine.kernels.rows)
    leave every tensor of both layers bit-equal to the torch path's (rows, order, scales, CSA2 side cache,
    zeroed merge counts), with ties between stored and recalled positions kept stored-first; the new rows in any
    order, or in position order (as a recall gives them: runs of them are copied together)."""
    @torch.inference_mode()
    def run():
        g = torch.Generator().manual_seed(taken + 100 * int8)
        hot = LayerKV(3, 8, torch.bfloat16, "cpu", int8=int8)
        hot.append(torch.randn(3, 50, 8, generator=g), torch.randn(3, 50, 8, generator=g), torch.arange(50) * 2)
        hot.scores[:, :50] = torch.rand(3, 50, generator=g)
        hot.log_counts[:, :50] = torch.rand(3, 50, generator=g)
        hot.projected_keys = torch.randn(3, hot.capacity, 4, generator=g)
        cold = ColdLayer(3, 8, torch.float32, "cpu", int8=int8)
        cold.add(hot, torch.stack([torch.randperm(50, generator=g)[:40].sort().values for _ in range(3)]))
        cold.positions[:, :5] += 1  # odd positions (between the hot set's) beside equal ones (ties)
        index = torch.stack([torch.randperm(40, generator=g)[:taken] for _ in range(3)])
        if sorted_index:
            index = torch.gather(index, 1, torch.gather(cold.positions[:, :40], 1, index).argsort(dim=1, stable=True))
        keys, values, positions, scores = cold.take(index)
        hot.insert(keys, values, positions, scores)
        return (cold.length, _layer_state(cold, cold._names(), cold.length), hot.length,
                _layer_state(hot, hot._tensors(), hot.length), keys, values, positions, scores)

    from engine.kernels import cache_ops as rows

    used = []

    def spy(real):
        def call(*args, **kwargs):
            result = real(*args, **kwargs)
            used.append(result is not None and result is not False)
            return result
        return call

    for name in ("take_rows", "insert_rows"):
        monkeypatch.setattr(rows, name, spy(getattr(rows, name)))
    fast = run()
    assert used == [True, True]  # both moves went through the kernels
    with monkeypatch.context() as m:
        _no_row_kernels(m)
        slow = run()
    assert fast[0] == slow[0] and fast[2] == slow[2] == 50 + taken
    for got, want in ((fast[1], slow[1]), (fast[3], slow[3])):
        assert got.keys() == want.keys()
        for name in got:
            assert torch.equal(got[name], want[name]), name
    for got, want in zip(fast[4:], slow[4:], strict=True):
        assert torch.equal(got, want)
    positions = fast[3]["positions"]
    assert bool((positions[:, 1:] >= positions[:, :-1]).all())  # every head in position order


def test_loosening_the_ratio_recalls_from_the_cold_tier_instead_of_re_reading():
    tiered = _cache(cold_tier="ram", cold_tier_dtype="auto")
    _read(tiered, 64, seed=5, window=64)
    everything = [_entries(layer) for layer in tiered.layers]
    tiered.finish_prefill()
    assert tiered.stored == tiered.budget() < 64
    assert tiered.apply(tiered.settings.replace(kv_cache_ratio=1.0)) == "recalled"
    assert tiered.stored == 64 and tiered.cold_bytes() == 0
    for layer, was in zip(tiered.layers, everything, strict=True):
        assert layer.positions[0, :64].tolist() == list(range(64))
        assert all(torch.equal(key, was[p]) for p, key in _entries(layer).items())
    # tightening sends entries back to the cold tier; a knob that changes the stored format still re-reads
    assert tiered.apply(tiered.settings.replace(kv_cache_ratio=0.25)) == "compacted"
    assert tiered.stored == tiered.budget() and tiered.cold[0].length == 64 - tiered.stored
    assert tiered.apply(tiered.settings.replace(kv_cache_dtype="int8")) == "needs_rebuild"
    plain = _cache()
    _read(plain, 64, seed=5, window=64)
    plain.finish_prefill()
    assert plain.apply(plain.settings.replace(kv_cache_ratio=1.0)) == "needs_rebuild"


def test_a_chat_with_the_cold_tier_never_loses_a_token_and_recalls_each_question(tiny_folder, monkeypatch):
    """Through real turns (a tiny model, the real tokenizer): every token seen is either hot or cold after each
    turn, each follow-up question recalls from the cold tier, its reply counts the cold tier (the counts gone
    when the turn ends), and the hot set stays within its budget."""
    from engine import DSV41Config, DSV41Model
    from engine.cache import cold as cold_module

    monkeypatch.setattr(cold_module, "RECALL_MIN", 16)  # the tiny chat's cold tier would come back whole
    counted = []
    original = DSV41Cache.count_cold

    def count_cold(self):
        original(self)
        counted.append(self.counting)

    monkeypatch.setattr(DSV41Cache, "count_cold", count_cold)
    model = DSV41Model.from_pretrained(DSV41Config(model_path=str(tiny_folder), max_seq_len=4096, kv_cache_ratio=0.2,
                                                   cold_tier="ram", csa2_topk=0))
    session = model.chat_session()
    document = " ".join(f"Line {i}: the value of item {i} is {i * 7}." for i in range(45))
    for turn, question in enumerate([document + "\n\nWhat is the value of item 3?", "And item 40?", "And item 25?"]):
        list(session.send(question, max_new_tokens=6, greedy=True))
        cache = session.cache
        assert cache.seen == len(session.transcript_ids)
        for layer, cold in zip(cache.layers, cache.cold, strict=True):
            assert layer.length + cold.length == cache.seen  # nothing discarded
            assert layer.length <= cache.budget()
            hot = set(layer.positions[0, : layer.length].tolist())
            assert not hot & set(cold.positions[0, : cold.length].tolist())
        assert not cache.counting and not any(layer.merged_any for layer in cache.layers)
        if turn:
            assert cache.recalled > 0
    assert counted == [True, True]  # each follow-up's reply, not the first question's
    report = model.memory_report(session.cache)
    assert report.kv_cold == session.cache.cold_bytes() > 0


def _mapped_cold_files(folder) -> int:
    """Cold-tier files of this process mapped from `folder` (unlinked at once, so only /proc/self/maps shows them)."""
    with open("/proc/self/maps") as maps:
        return len({line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                    for line in maps if str(folder) in line})


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
@pytest.mark.parametrize("tier,cap_mb", [("disk", 2048), ("ram", 0)])
def test_a_cold_tier_on_disk_or_past_its_ram_cap_lives_in_mapped_files_and_recalls_the_same(tmp_path, monkeypatch,
                                                                                            tier, cap_mb):
    monkeypatch.setenv("DSV41_COLD_DIR", str(tmp_path))
    in_ram = _cache(cold_tier="ram", cold_tier_dtype="auto")
    spilled = _cache(cold_tier=tier, cold_tier_dtype="auto", cold_tier_ram_mb=cap_mb)
    for cache in (in_ram, spilled):
        _read(cache, 64, seed=9, window=64)
        cache.compact()
    assert all(not c.on_disk for c in in_ram.cold) and all(c.on_disk for c in spilled.cold)
    assert spilled.cold_bytes("disk") == spilled.cold_bytes() == in_ram.cold_bytes("ram") > 0
    assert spilled.cold_bytes("ram") == 0
    assert not list(tmp_path.iterdir())  # unlinked at once: nothing is left behind, even after a crash
    assert _mapped_cold_files(tmp_path) > 0
    for a, b in zip(in_ram.cold, spilled.cold, strict=True):
        assert torch.equal(a.read_keys(), b.read_keys()) and torch.equal(a.positions[:, :a.length],
                                                                          b.positions[:, :b.length])
    assert spilled.apply(spilled.settings.replace(kv_cache_ratio=1.0)) == "recalled" and spilled.stored == 64


def test_a_cold_folder_that_cannot_be_written_keeps_the_cold_tier_in_ram(tmp_path, monkeypatch, caplog):
    # a full or read-only folder made every turn fail ("unable to write to file") and the cache stop compressing
    blocked = tmp_path / "a file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("DSV41_COLD_DIR", str(blocked / "cold"))
    in_ram = _cache(cold_tier="ram", cold_tier_dtype="auto")
    spilled = _cache(cold_tier="disk", cold_tier_dtype="auto")
    for cache in (in_ram, spilled):
        _read(cache, 64, seed=9, window=64)
        cache.compact()
    assert all(not c.on_disk for c in spilled.cold) and spilled.cold_bytes("ram") == in_ram.cold_bytes("ram") > 0
    assert spilled.stored == in_ram.stored < 64  # compacted as in RAM
    for a, b in zip(in_ram.cold, spilled.cold, strict=True):
        assert torch.equal(a.read_keys(), b.read_keys())
    assert sum("could not use" in r.getMessage() and "DSV41_COLD_DIR" in r.getMessage() for r in caplog.records) == 1


def test_the_ram_cap_keeps_the_first_layers_in_ram_and_spills_the_rest(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV41_COLD_DIR", str(tmp_path))
    settings = CacheSettings(kv_cache_ratio=0.25, csa2_topk=0, ced_threshold=0.0, min_entries=8,
                             cold_tier="ram", cold_tier_dtype="auto", cold_tier_ram_mb=2)
    cache = DSV41Cache(3, 2, 128, torch.float32, "cpu", settings)  # about 1.6 MB of cold entries per layer
    g = torch.Generator().manual_seed(4)
    cache.begin_forward(800, score_window=800, prefill=True)
    with torch.inference_mode():  # as the model's forward runs it
        for index in range(3):
            q, k, v = (torch.randn(1, n, 800, 128, generator=g) for n in (4, 2, 2))
            cache.attend(index, q, k, v, 128**-0.5)
    cache.end_forward()
    cache.compact()
    assert [c.on_disk for c in cache.cold] == [False, True, True]
    assert sum(c.reserved_bytes() for c in cache.cold if not c.on_disk) <= 2 * 2**20
    assert cache.cold_bytes("ram") + cache.cold_bytes("disk") == cache.cold_bytes()
    assert all(layer.length + cold.length == 800 for layer, cold in zip(cache.layers, cache.cold, strict=True))


def test_a_question_forward_that_fails_part_way_drops_its_own_entries_and_keeps_what_it_recalled():
    cache = _cache(cold_tier="ram")
    _read(cache, 64, seed=6, window=64)
    cache.compact()
    lengths = [layer.length for layer in cache.layers]
    cold = cache.cold[0]
    key = cold.read_keys()[:, 0]
    q = (key * 40).repeat_interleave(2, dim=0)[None, :, None, :].expand(1, 4, 4, 8).contiguous()
    cache.begin_forward(4, score_window=4, prefill=True, question=True)
    cache.attend(0, q, torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), 8**-0.5)  # layer 1 never runs: a failure
    recalled = cache.layers[0].length - lengths[0] - 4
    assert recalled > 0 and cache.recalled == recalled
    cache.abort_forward()
    layer = cache.layers[0]
    positions = layer.positions[0, : layer.length].tolist()
    assert layer.length == lengths[0] + recalled and max(positions) < 64 and positions == sorted(positions)
    assert cache.layers[1].length == lengths[1]
    assert layer.length + cold.length == 64  # nothing lost: recalled entries are hot, the rest still cold


def test_a_tiered_reply_attends_to_what_its_question_read_and_the_turn_ends_at_the_budget():
    """Tiered CED answers before compacting: the reply's steps see everything its question's forward held
    (compacting before the reply lost first answers: 7/12 against 12/12 at ratio 0.1), the reply's own
    entries are compacted only past REPLY_ROOM, and finish_turn brings the hot set back to the budget with
    nothing lost. Without the cold tier, and for the baselines, the compaction stays before the reply."""
    from engine.cache.kv_cache import REPLY_ROOM

    tiered = _cache(cold_tier="ram", cold_tier_dtype="auto")
    _read(tiered, 64, seed=7, window=64)
    assert tiered.answers_before_compacting
    tiered.finish_prefill(answer_follows=True)
    assert tiered.stored == 64 > tiered.budget() and tiered.answer_limit == 64
    for step in range(1, 18):  # a short reply: past compact_every, never past the reply's room
        _read(tiered, 1, seed=100 + step, window=1)
        tiered.decode_steps += 1
        tiered.after_decode_step()
    assert tiered.stored == 64 + 17 < 64 + REPLY_ROOM
    tiered.finish_turn()
    assert tiered.answer_limit is None and tiered.stored == tiered.budget()
    for layer, cold in zip(tiered.layers, tiered.cold, strict=True):
        kept = set(layer.positions[0, : layer.length].tolist()) | set(cold.positions[0, : cold.length].tolist())
        assert kept == set(range(64 + 17))  # every token is hot or cold
    # the next turn starts from the budget again; a rebuild's finish_prefill (no reply) compacts at once
    _read(tiered, 8, seed=9, window=8)
    tiered.finish_prefill()
    assert tiered.stored == tiered.budget()
    for knobs in ({}, {"ced_policy": "snapkv", "cold_tier": "ram"}):
        other = _cache(**knobs)
        _read(other, 64, seed=7, window=64)
        assert not other.answers_before_compacting
        other.finish_prefill(answer_follows=True)
        assert other.stored == other.budget() and other.answer_limit is None


@pytest.mark.parametrize("path", ["C", "torch"])
@pytest.mark.parametrize("merged", [False, True])
def test_recall_mass_is_each_cold_entrys_share_of_one_softmax_over_hot_and_cold(monkeypatch, merged, path):
    """The recall ranks cold entries by the attention they would get if hot: one softmax over the hot entries
    (causal over the question's own, merge counts as log-biases) and every cold one, summed over the queries --
    through the C pass per row (engine.kernels.cache_ops.recall_softmax) and through torch alike."""
    from engine.cache.cold import recall_mass
    from engine.kernels import cache_ops

    if path == "C" and kernels.load() is None:
        pytest.skip(f"CPU kernels: {kernels.unavailable_reason()}")
    real, calls = cache_ops.recall_softmax, []
    monkeypatch.setattr(cache_ops, "recall_softmax",
                        (lambda *a: calls.append(1) or real(*a)) if path == "C" else (lambda *a: None))

    g = torch.Generator().manual_seed(4)
    h, groups, d, s, c, tq = 2, 3, 16, 40, 70, 6
    query = torch.randn(h * groups, tq, d, generator=g) * 2
    hot, cold = torch.randn(h, s, d, generator=g) * 2, torch.randn(h, c, d, generator=g) * 2
    counts = torch.rand(h, s, generator=g).mul(3).add(1).log() if merged else None
    got = recall_mass(query, hot, cold, counts, 0.25)
    q = query.double().reshape(h, groups * tq, d)
    hot_logits = q @ hot.double().transpose(1, 2) * 0.25 + (0 if counts is None else counts.double()[:, None, :])
    future = torch.ones(tq, tq, dtype=torch.bool).triu(1).repeat(groups, 1)  # query i sees hot entries up to its own
    hot_logits[:, :, s - tq:] = hot_logits[:, :, s - tq:].masked_fill(future[None], float("-inf"))
    probs = torch.softmax(torch.cat([hot_logits, q @ cold.double().transpose(1, 2) * 0.25], dim=-1), dim=-1)
    assert torch.allclose(got.double(), probs[..., s:].sum(dim=1), atol=1e-5)
    assert got.shape == (h, c) and float(got.sum()) <= h * groups * tq + 1e-4
    assert calls == ([1] if path == "C" else [])


@pytest.mark.parametrize("cold_type", [torch.int8, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hot_type", [torch.bfloat16, torch.float32])
def test_the_one_call_recall_scoring_reads_the_keys_as_stored_and_ranks_as_torch_does(cold_type, hot_type):
    """engine.kernels.cache_ops.recall_mass (what a CPU recall runs): the cold keys as stored (int8 with their
    scales, against int16 query rows; bf16 and float32 widened key by key) and the hot keys as views of a layer's
    storage, against cold.recall_mass. Query rows that do not fill a vector (2 x 7 here), a causal tail,
    merge counts; the same top entries."""
    from engine.cache.cold import recall_mass
    from engine.kernels import cache_ops
    from engine.kernels.quant import quantize_int8

    if kernels.load() is None:
        pytest.skip(f"CPU kernels: {kernels.unavailable_reason()}")
    g = torch.Generator().manual_seed(5)
    h, groups, d, s, c, tq, capacity = 2, 2, 32, 45, 301, 7, 320
    query = torch.randn(h * groups, tq, d, generator=g) * 2
    hot_store = (torch.randn(h, capacity, d, generator=g) * 2).to(hot_type)
    cold_full = torch.randn(h, capacity, d, generator=g) * 2
    if cold_type == torch.int8:
        cold_store, scale_store = quantize_int8(cold_full)
        scales = scale_store[:, :c]
    else:
        cold_store, scales = cold_full.to(cold_type), None
    counts_store = torch.rand(h, capacity, generator=g).mul(3).add(1).log()
    for counts in (None, counts_store[:, :s]):
        want = recall_mass(query, hot_store[:, :s], cold_store[:, :c], counts, 0.3, scales)
        got = cache_ops.recall_mass(query, hot_store[:, :s], cold_store[:, :c], scales, counts, 0.3)
        assert got is not None and got.shape == (h, c)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)
        assert torch.equal(got.topk(40, dim=1).indices.sort(dim=1).values,
                           want.topk(40, dim=1).indices.sort(dim=1).values)
    # where it does not apply, the caller takes torch's path
    assert cache_ops.recall_mass(query, hot_store[:, :s].half(), cold_store[:, :c], scales, None, 0.3) is None
    assert cache_ops.recall_mass(query, hot_store[:, :s, ::2], cold_store[:, :c], scales, None, 0.3) is None


def _int8_cold(h, c, d, *, seed):
    from engine.kernels.quant import quantize_int8

    g = torch.Generator().manual_seed(seed)
    return quantize_int8(torch.randn(h, c, d, generator=g) * 2)


def test_cold_logits_of_int8_keys_are_the_exact_integer_sums_rounded_once():
    """cold.cold_logits on int8 keys: each query row rounded to int16 with its own scale, the exact integer sum of
    its products with the key's int8 values rounded once to float32, x the key's scale, x the row's. Rows at the
    int16 extremes against keys at +-127 make sums past 2^24, where float32 products of the int16 values summed in
    float32 would round along the way; the result stays within int16 rounding of the float32 logits."""
    from engine.cache.cold import cold_logits
    from engine.kernels.quant import integer_products, quantize_int16

    h, r, c, d = 2, 9, 50, 64
    g = torch.Generator().manual_seed(11)
    q = torch.randn(h, r, d, generator=g)
    q[:, :3] = torch.where(torch.rand(h, 3, d, generator=g) < 0.5, -1.0, 1.0) * (1 + 1e-4 * torch.rand(h, 3, d))
    keys, scales = _int8_cold(h, c, d, seed=12)
    keys[:, :4] = torch.where(torch.rand(h, 4, d, generator=g) < 0.5, -127, 127).to(torch.int8)
    got = cold_logits(q, keys, scales)
    rows, row_scales = quantize_int16(q)
    exact = torch.matmul(rows.long(), keys.long().transpose(1, 2))
    assert int(exact.abs().max()) > 1 << 24
    want = exact.float().mul_(scales.transpose(1, 2)).mul_(row_scales)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    for split in (False, True):  # a CPU's float64 product and a GPU's two float32 products of the bytes
        assert torch.equal(integer_products(rows, keys, split=split), exact.float()), split
    assert not torch.equal(torch.matmul(rows.float(), keys.float().transpose(1, 2)), exact.float())
    widened = torch.matmul(q, (keys.float() * scales).transpose(1, 2))
    assert float((got - widened).abs().max() / widened.abs().max()) < 1e-4
    # float keys: the float32 products of the widened keys, unchanged
    assert torch.equal(cold_logits(q, keys.float() * scales, None), widened)


def _kernel_builds():
    """The kernel builds this CPU runs: native, and with fewer instruction sets ((flags, library) pairs)."""
    from engine.kernels import library

    native = kernels.load()
    if native is None:
        return []
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            flags = info.read()
    except OSError:
        flags = ""
    builds = [("native", native)]
    if native.isa == 512 and " avx512_vnni" in flags:
        builds.append(("-mno-avx512vnni", library.build(("-mno-avx512vnni",))))
    if native.isa == 512:
        builds.append(("-mno-avx512f", library.build(("-mno-avx512f",))))
    return builds


def test_the_c_scoring_of_int8_cold_keys_takes_the_integer_logits_on_every_build(monkeypatch):
    """cache_ops.recall_mass from int8 cold keys (vpdpwssd with AVX-512 VNNI, vpmaddwd on AVX-512 BW and AVX2)
    against cold.recall_mass with cold_logits' definition: the same masses (the two AVX-512 builds bit for bit) and
    the same top entries. A query whose other components are below int16's step of its largest sees every key
    alike when their first components are equal: the masses are then exactly equal, where float32 logits of the
    widened keys (the small components) would tell them apart."""
    from engine.cache.cold import recall_mass
    from engine.kernels import cache_ops

    builds = _kernel_builds()
    if not builds:
        pytest.skip(f"CPU kernels: {kernels.unavailable_reason()}")
    g = torch.Generator().manual_seed(13)
    h, groups, d, s, c, tq = 3, 3, 64, 70, 517, 7  # 21 rows: a whole vector and part of another on AVX-512
    query = torch.randn(h * groups, tq, d, generator=g) * 2
    hot = (torch.randn(h, s, d, generator=g) * 2).to(torch.bfloat16)
    keys, scales = _int8_cold(h, c, d, seed=14)
    counts = torch.rand(h, s, generator=g).mul(3).add(1).log()
    flat_query = torch.zeros(h * groups, tq, d)
    flat_query[..., 0] = 3.0
    flat_query[..., 1:] = 1e-5 * torch.randn(h * groups, tq, d - 1, generator=g)
    flat_keys = keys.clone()
    flat_keys[..., 0] = 127
    masses = {}
    for name, library in builds:
        monkeypatch.setattr(cache_ops, "load", lambda library=library: library)
        for lc in (None, counts):
            want = recall_mass(query, hot, keys, lc, 0.3, scales)
            got = cache_ops.recall_mass(query, hot, keys, scales, lc, 0.3)
            assert got is not None, name
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-7), name
            assert torch.equal(got.topk(64, dim=1).indices.sort(dim=1).values,
                               want.topk(64, dim=1).indices.sort(dim=1).values), name
            masses[name, lc is None] = got
        flat = cache_ops.recall_mass(flat_query, hot, flat_keys, scales.mul(0).add(0.01), None, 0.3)
        assert torch.equal(flat, flat[:, :1].expand_as(flat)), name
        widened = recall_mass(flat_query, hot, flat_keys.float() * 0.01, None, 0.3)
        assert not torch.equal(widened, widened[:, :1].expand_as(widened))
    if ("-mno-avx512vnni", True) in masses:
        assert torch.equal(masses["native", True], masses["-mno-avx512vnni", True])
        assert torch.equal(masses["native", False], masses["-mno-avx512vnni", False])


@pytest.mark.gpu
def test_on_a_gpu_the_recalls_cold_logits_and_choice_are_the_cpu_ones():
    """cold_logits on CUDA (the high and low bytes' float32 products there, TF32 allowed) equal the CPU's bit for bit,
    so a recall on a GPU picks the entries a CPU recall picks."""
    from engine.cache.cold import cold_logits, recall_mass

    keys, scales = _int8_cold(3, 700, 64, seed=15)
    g = torch.Generator().manual_seed(16)
    q = torch.randn(3, 60, 64, generator=g)
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:
        for tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            on_gpu = cold_logits(q.cuda(), keys.cuda(), scales.cuda()).cpu()
            assert torch.equal(on_gpu, cold_logits(q, keys, scales)), tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    query = torch.randn(9, 20, 64, generator=g)
    hot = torch.randn(3, 300, 64, generator=g)
    cpu = recall_mass(query, hot, keys, None, 0.125, scales)
    gpu = recall_mass(query.cuda(), hot.cuda(), keys.cuda(), None, 0.125, scales.cuda()).cpu()
    assert torch.allclose(cpu, gpu, rtol=1e-4, atol=1e-7)
    assert torch.equal(cpu.topk(128, dim=1).indices.sort(dim=1).values, gpu.topk(128, dim=1).indices.sort(dim=1).values)


@pytest.mark.parametrize("span", [1, 16, 12])
def test_the_one_call_recall_choice_takes_the_entries_torch_takes_in_position_order(span):
    """engine.kernels.cache_ops.recall_select (what a CPU recall runs after its scoring) against cold.span_ranking,
    topk and the sort by position: the same indices in the same order, positions as a view of a cold layer."""
    from engine.cache.policies.ced import span_ranking
    from engine.kernels import cache_ops

    if kernels.load() is None:
        pytest.skip(f"CPU kernels: {kernels.unavailable_reason()}")
    g = torch.Generator().manual_seed(6)
    h, c, capacity, take = 3, 1000, 1100, 96
    positions = torch.stack([torch.randperm(3000, generator=g)[:capacity] for _ in range(h)]).int()[:, :c]
    mass = torch.rand(h, c, generator=g) ** 4
    rank = span_ranking(mass, positions, span) if span > 1 else mass
    index = rank.topk(take, dim=1).indices
    want = torch.gather(index, 1, torch.gather(positions, 1, index).argsort(dim=1))
    got = cache_ops.recall_select(mass, positions, span, take)
    assert torch.equal(got, want)
    assert torch.equal(cache_ops.recall_select(mass, positions, span, c).sort(dim=1).values,
                       torch.arange(c).expand(h, -1))  # everything, once
    assert cache_ops.recall_select(mass.double(), positions, span, take) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_question_that_recalls_attends_with_the_logits_its_recall_computed_as_if_computed_again(monkeypatch, dtype):
    """A follow-up's question chunk on a CPU: the recall keeps the hot entries' logits it computed and the question's
    attention takes them (cache_ops.HotLogits: rows paired with the layer's entries by position after the merge)
    instead of computing them again. Outputs and scores are bit-equal to the same turns with nothing shared, and
    logits whose positions do not pair with the layer's are not taken."""
    from engine.kernels import cache_ops

    if kernels.load() is None:
        pytest.skip(f"CPU kernels: {kernels.unavailable_reason()}")
    d = 16
    real_qa = cache_ops.question_attention

    def run(share: bool):
        settings = CacheSettings(kv_cache_ratio=0.25, csa2_topk=0, ced_sink_tokens=2, ced_recent_tokens=4,
                                 min_entries=8, ced_threshold=0.0, cold_tier="ram")
        cache = DSV41Cache(2, 2, d, dtype, "cpu", settings)
        g = torch.Generator().manual_seed(11)
        outs, calls = [], []

        def attend(*args):
            got = real_qa(*args[:-1], args[-1] if share else None)
            calls.append((args, share and args[-1] is not None and got is not None))
            return got

        monkeypatch.setattr(cache_ops, "question_attention", attend)
        for tokens, window in ((300, 300), (12, 12), (9, 9)):
            cache.begin_forward(tokens, score_window=window, prefill=True, question=True)
            for index in range(2):
                q, k, v = (torch.randn(1, h, tokens, d, generator=g).to(dtype) for h in (4, 2, 2))
                outs.append(cache.attend(index, q, k, v, d**-0.5))
            cache.end_forward()
            cache.finish_prefill()
        scores = [layer.scores[:, : layer.length].clone() for layer in cache.layers]
        return outs, scores, calls, cache

    with torch.inference_mode():  # as a model's forward runs
        shared_out, shared_scores, calls, cache = run(True)
        plain_out, plain_scores, _, _ = run(False)
        assert cache.recalled > 0 and [taken for _, taken in calls].count(True) == 4  # 2 follow-ups x 2 layers
        assert all(torch.equal(a, b) for a, b in zip(shared_out, plain_out, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(shared_scores, plain_scores, strict=True))
        # logits whose positions are not the layer's hot entries' (here: shifted by one) are not taken
        args, _ = calls[-1]
        query, keys, values, counts, scaling, last, shared = args
        want = real_qa(query, keys, values, counts, scaling, last, None)
        wrong = cache_ops.HotLogits(shared.logits.clone().fill_(50.0), shared.rows, shared.positions + 1, shared.merged)
        got = real_qa(query, keys, values, counts, scaling, last, wrong)
        assert torch.equal(real_qa(query, keys, values, counts, scaling, last, shared)[0], want[0])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_cache_with_the_cold_tier_is_freed_as_soon_as_it_is_dropped():
    """No reference cycle: a dropped chat's cache (its hot and cold tensors) goes at once, not at some later run
    of the cyclic collector (a server dropping chats grew by 900 MiB over 240 of them that way)."""
    import gc
    import weakref

    gc.disable()
    try:
        cache = _cache(cold_tier="ram", kv_cache_ratio=0.25)
        _read(cache, 300, seed=0)
        cache.finish_prefill()
        assert cache.cold_bytes() > 0  # the cold tier holds something (and has asked where to spill)
        gone = weakref.ref(cache)
        del cache
        assert gone() is None
    finally:
        gc.enable()


@pytest.mark.gpu
def test_on_a_gpu_the_cold_tier_is_pinned_and_its_keys_reach_the_device_as_stored():
    settings = CacheSettings(kv_cache_ratio=0.25, csa2_topk=0, ced_sink_tokens=2, ced_recent_tokens=4, min_entries=8,
                             ced_threshold=0.0, cold_tier="ram")
    cache = DSV41Cache(2, 2, 8, torch.float32, "cuda", settings)
    _read(cache, 300, seed=0)
    cache.finish_prefill()
    assert cache.cold_bytes() > 0
    for cold in cache.cold:
        assert cold.pinned and cold.keys.is_pinned() and cold.key_scales.is_pinned()
        keys, scales = cold.stored_keys_to(torch.device("cuda"))
        torch.cuda.synchronize()
        assert keys.device.type == "cuda" and keys.dtype == torch.int8 and scales.device.type == "cuda"
        assert torch.equal(keys.cpu(), cold.keys[:, : cold.length])
        assert torch.equal(scales.cpu(), cold.key_scales[:, : cold.length])
    host = _cache(cold_tier="ram")
    assert not any(cold.pinned for cold in host.cold)  # a CPU cache keeps ordinary RAM


@pytest.mark.skipif(kernels.load() is None, reason=f"CPU kernels: {kernels.unavailable_reason()}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("d", [8, 64, 72])
def test_a_compactions_rows_go_cold_through_one_c_call_exactly_as_through_torch(monkeypatch, dtype, int8, d):
    """ColdLayer.add moves a compaction's dropped rows (gathered, quantized to int8 or kept in the hot dtype) in one
    C call (cache_ops.cold_add): every cold tensor bit-equal to the torch path's, across a growth of the tier, for
    head dims below, at and past a vector's 16 lanes; an index out of range is refused before anything is
    written."""
    from engine.kernels import cache_ops

    @torch.inference_mode()
    def run():
        g = torch.Generator().manual_seed(7)
        hot = LayerKV(3, d, dtype, "cpu")
        hot.append(torch.randn(3, 300, d, generator=g) * 3, torch.randn(3, 300, d, generator=g), torch.arange(300))
        hot.keys[1, 5] = 0  # an all-zero row: scale from the 1e-8 floor, zeros back
        ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, -126.5])  # scale 1: halves round to even
        hot.keys[2, 9] = ties.repeat(d // 8 + 1)[:d]
        hot.scores[:, :300] = torch.rand(3, 300, generator=g)
        cold = ColdLayer(3, d, dtype, "cpu", int8=int8)
        for taken in (40, 250):  # the second add grows the tier past its first block
            cold.add(hot, torch.stack([torch.randperm(300, generator=g)[:taken] for _ in range(3)]))
        return cold

    used = []
    real = cache_ops.cold_add
    monkeypatch.setattr(cache_ops, "cold_add", lambda *a, **k: used.append(real(*a, **k)) or used[-1])
    fast = run()
    assert used == [True, True]
    with monkeypatch.context() as m:
        m.setattr(cache_ops, "cold_add", lambda *a, **k: False)
        slow = run()
    assert fast.length == slow.length == 290
    for name in fast._names():
        assert torch.equal(getattr(fast, name)[:, :290], getattr(slow, name)[:, :290]), name
    if int8:  # the tie row itself, against round-half-to-even
        row = int((fast.positions[2, :290] == 9).nonzero()[0])  # (both adds may have taken it)
        assert fast.keys[2, row].tolist() == torch.tensor([127, 0, 2, 2, 0, -2, 4, -126]).repeat(d // 8 + 1)[:d].tolist()
    hot = LayerKV(3, d, dtype, "cpu")
    hot.append(torch.randn(3, 10, d), torch.randn(3, 10, d), torch.arange(10))
    before = {name: getattr(fast, name)[:, :290].clone() for name in fast._names()}
    with pytest.raises(ValueError, match="out of range"):
        fast.add(hot, torch.full((3, 2), 10))
    assert fast.length == 290 and all(torch.equal(getattr(fast, n)[:, :290], b) for n, b in before.items())
    # a hot layer of another head dim is not this tier's: refused by the C call's checks, never written past a row
    other = LayerKV(3, d + 8, dtype, "cpu")
    other.append(torch.randn(3, 10, d + 8), torch.randn(3, 10, d + 8), torch.arange(10))
    cold = [fast.keys, fast.values, fast.key_scales, fast.value_scales, fast.positions, fast.scores]
    assert not cache_ops.cold_add([other.keys, other.values, other.positions, other.scores], cold,
                                  torch.zeros(3, 2, dtype=torch.int64), 10, fast.length, int8)


@pytest.mark.parametrize("tier", ["off", "ram"])
def test_the_question_compaction_runs_after_the_first_reply_token_and_changes_no_token(tiny_folder, monkeypatch,
                                                                                      tier):
    """run_turn samples the first reply token before the cache's work after the question (finish_prefill), which that
    token does not depend on: the replies are the tokens the old order gave, and each turn still ends at the
    budget, whether the reply runs on, stops at its first token or is cancelled after it. The token is shown before
    that work, except in a tiered follow-up that recalled (DSV41Cache.readies_reply_first), whose compaction and
    counts of the cold tier count in its first-token latency instead of stalling the reply after its first token."""
    import threading

    from engine import DSV41Config, DSV41Model
    from engine import generate as gen
    from engine.cache import cold as cold_module
    from engine.cache import kv_cache
    from engine.events import Done, TokenText

    monkeypatch.setattr(cold_module, "RECALL_MIN", 16)  # the tiny chat's cold tier would come back whole
    model = DSV41Model.from_pretrained(DSV41Config(model_path=str(tiny_folder), max_seq_len=4096, kv_cache_ratio=0.2,
                                                   cold_tier=tier, csa2_topk=0))
    document = " ".join(f"Line {i}: the value of item {i} is {i * 7}." for i in range(45))
    questions = [document + "\n\nWhat is the value of item 3?", "And item 40?", "And item 25?"]
    log = []  # a turn in order: "sample" (a reply token chosen), "finish" (finish_prefill), "shown" (its first text)
    real_sample, real_finish = gen.next_token, kv_cache.DSV41Cache.finish_prefill
    visible = model.tokenizer.encode("The", add_special_tokens=False)[0]

    def sample(*args, **kwargs):  # a reply's first token is one with text (the tiny model's own may show none)
        first = "sample" not in log
        log.append("sample")
        token, ids = real_sample(*args, **kwargs)
        return (visible, None if ids is None else torch.full_like(ids, visible)) if first else (token, ids)

    monkeypatch.setattr(gen, "next_token", sample)
    monkeypatch.setattr(kv_cache.DSV41Cache, "finish_prefill",
                        lambda self, **k: log.append("finish") or real_finish(self, **k))

    def chat():
        session, replies, orders = model.chat_session(), [], []
        for question in questions:
            log.clear()
            for event in session.send(question, max_new_tokens=6, greedy=True):
                if isinstance(event, TokenText) and "shown" not in log:
                    log.append("shown")
                if isinstance(event, Done):
                    replies.append(event.token_ids)
            orders.append(log[:3] + ["recalled"] * (session.cache.recalled > 0))
            assert session.cache.stored <= session.cache.budget() < session.cache.seen
        return replies, orders

    replies, orders = chat()
    if tier == "off":
        assert orders == [["sample", "shown", "finish"]] * 3
    else:  # the follow-ups recall, and their work comes before the token is shown
        assert orders == [["sample", "shown", "finish"]] + [["sample", "finish", "shown", "recalled"]] * 2
    real_prefill = gen._prefill

    def compacting_first(model_, cache, *args):  # the old order: finish_prefill before the first token
        logits = yield from real_prefill(model_, cache, *args)
        if logits is not None:
            cache.finish_prefill(answer_follows=True)
        return logits

    monkeypatch.setattr(gen, "_prefill", compacting_first)
    old_replies, old_orders = chat()
    assert [order[:2] for order in old_orders] == [["finish", "sample"]] * 3 and replies == old_replies
    monkeypatch.setattr(gen, "_prefill", real_prefill)
    # a reply of one token, and a reply cancelled after its first token, end the turn at the budget too
    session = model.chat_session()
    list(session.send(questions[0], max_new_tokens=1, greedy=True))
    assert session.cache.stored <= session.cache.budget() < session.cache.seen
    session, cancel = model.chat_session(), threading.Event()
    for event in session.send(questions[0], max_new_tokens=8, greedy=True, cancel=cancel):
        if isinstance(event, TokenText):
            cancel.set()
    assert session.cache.stored <= session.cache.budget() < session.cache.seen


@pytest.mark.skipif(kernels.load() is None, reason=f"CPU kernels: {kernels.unavailable_reason()}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("sorted_index", [False, True])
@pytest.mark.parametrize("d", [8, 72])
def test_a_recall_moved_in_one_c_call_is_bit_equal_to_take_then_insert(dtype, int8, sorted_index, d):
    """ColdLayer.move_into (dsv41_recall_move) leaves the cold and the hot layer exactly as take + insert do: rows,
    position order (ties stored-first), the widened keys and values in the hot dtype (d = 72: sixteen at a time on
    AVX-512 and the rest one by one), scores, zeroed merge counts and CSA2 projections, the cold layer's holes
    filled the same way; the rows taken in position order (runs of new rows moved together) or not."""
    @torch.inference_mode()
    def run(fused: bool):
        g = torch.Generator().manual_seed(7 + int8 + 2 * sorted_index)
        hot = LayerKV(3, d, dtype, "cpu")
        hot.append(torch.randn(3, 60, d, generator=g), torch.randn(3, 60, d, generator=g), torch.arange(60) * 2)
        hot.scores[:, :60] = torch.rand(3, 60, generator=g)
        hot.log_counts[:, :60] = torch.rand(3, 60, generator=g)
        hot.projected_keys = torch.randn(3, hot.capacity, 4, generator=g)
        cold = ColdLayer(3, d, dtype, "cpu", int8=int8)
        cold.add(hot, torch.stack([torch.randperm(60, generator=g)[:45].sort().values for _ in range(3)]))
        hot.keep(torch.arange(15).expand(3, -1).contiguous())
        cold.positions[:, :5] += 1  # odd positions beside equal ones (ties with what stays hot)
        index = torch.stack([torch.randperm(45, generator=g)[:20] for _ in range(3)])
        if sorted_index:
            index = torch.gather(index, 1, torch.gather(cold.positions[:, :45], 1, index).argsort(dim=1))
        if fused:
            assert cold.move_into(hot, index)
        else:
            keys, values, positions, scores = cold.take(index)
            hot.insert(keys, values, positions, scores)
        return (cold.length, _layer_state(cold, cold._names(), cold.length), hot.length,
                _layer_state(hot, hot._tensors(), hot.length))

    fast, slow = run(True), run(False)
    assert fast[0] == slow[0] == 25 and fast[2] == slow[2] == 35
    for got, want in ((fast[1], slow[1]), (fast[3], slow[3])):
        assert got.keys() == want.keys()
        for name in got:
            assert torch.equal(got[name], want[name]), name
    assert bool((fast[3]["positions"][:, 1:] >= fast[3]["positions"][:, :-1]).all())
    cold = ColdLayer(3, 8, dtype, "cpu", int8=int8)  # a bad index changes nothing
    hot = LayerKV(3, 8, dtype, "cpu")
    hot.append(torch.randn(3, 10, 8), torch.randn(3, 10, 8), torch.arange(10))
    cold.add(hot, torch.arange(4).expand(3, -1).contiguous())
    with pytest.raises(ValueError):
        cold.move_into(hot, torch.tensor([[0, 0]] * 3))
    assert cold.length == 4 and hot.length == 10
    from engine.kernels import cache_ops  # a hot layer of another head dim: refused, never written past a row

    wide = LayerKV(3, 16, dtype, "cpu")
    wide.append(torch.randn(3, 10, 16), torch.randn(3, 10, 16), torch.arange(10))
    names = ["keys", "values", "positions", "scores"] + (["key_scales", "value_scales"] if int8 else [])
    assert not cache_ops.recall_move([getattr(cold, n) for n in names], int8, cold.length,
                                     [wide.keys, wide.values, wide.positions, wide.scores], wide.length,
                                     torch.zeros(3, 1, dtype=torch.int64))


@pytest.mark.skipif(kernels.load() is None, reason=f"CPU kernels: {kernels.unavailable_reason()}")
def test_the_c_calls_refuse_shapes_they_would_read_or_write_past():
    """Every cache_ops wrapper checks the shapes its C call relies on: an index of more heads than the tensors, a
    cold tier of other heads or rows, a log-count or scale table shorter than its keys, a query of another head dim
    or a count past the keys are refused (None / False: the torch path runs), never passed on to write or read past
    a tensor."""
    from engine.kernels import cache_ops

    h, s, c, d = 3, 40, 30, 32
    keys, values = torch.randn(h, s, d), torch.randn(h, s, d)
    positions = torch.arange(s, dtype=torch.int32).expand(h, -1).contiguous()
    scores = torch.rand(h, s)
    rows = [keys, values, positions, scores]
    assert cache_ops.take_rows(rows, torch.zeros(h + 1, 2, dtype=torch.int64), s) is None
    assert not cache_ops.keep_rows(rows, torch.arange(4).expand(h + 1, -1).contiguous(), s)
    assert cache_ops.take_rows(rows, torch.tensor([[0, 1]] * h), s) is not None  # the right shape still runs
    query = torch.randn(2 * h, 5, d)
    cold = torch.randn(h, c, d)
    assert cache_ops.recall_mass(torch.randn(2 * h, 5, 2 * d), keys, cold, None, None, 0.3) is None
    assert cache_ops.recall_mass(query, keys, cold, None, torch.zeros(h, s - 1), 0.3) is None
    cold8 = (cold * 20).to(torch.int8)
    assert cache_ops.recall_mass(query, keys, cold8, torch.ones(h, c - 1, 1), None, 0.3) is None
    assert cache_ops.recall_mass(query, keys, cold8, torch.ones(h, c, 1), None, 0.3) is not None
    assert cache_ops.question_attention(torch.randn(2 * h, 5, 2 * d), keys, values, None, 0.3, 5) is None
    assert cache_ops.question_attention(query, keys, values, torch.zeros(h, s - 1), 0.3, 5) is None
    assert cache_ops.question_attention(query, keys, values, torch.zeros(h, s), 0.3, 5) is not None
    hot_logits = torch.randn(h, 10, s)
    assert cache_ops.recall_softmax(hot_logits, torch.randn(h, 9, c), None, 5) is None
    assert cache_ops.recall_softmax(hot_logits, torch.randn(h, 10, c), torch.zeros(h, s - 1), 5) is None
    assert cache_ops.recall_softmax(hot_logits, torch.randn(h, 10, c), torch.zeros(h, s), 5) is not None
    from engine.cache.counts import COUNT_BITS, COUNT_TABLES, count_planes

    planes = count_planes(d, "cpu")
    sizes = torch.zeros(h, COUNT_TABLES << COUNT_BITS, dtype=torch.int16)
    index = torch.arange(4).expand(h, -1).contiguous()
    assert not cache_ops.lsh_tally(cold8, c + 1, index, planes, COUNT_TABLES, COUNT_BITS, sizes, +1)
    assert not cache_ops.lsh_tally(cold8, c, torch.arange(4).expand(h + 1, -1).contiguous(), planes, COUNT_TABLES,
                                   COUNT_BITS, sizes, +1)
    assert not sizes.any()  # nothing was counted by the refused calls
    assert cache_ops.lsh_tally(cold8, c, index, planes, COUNT_TABLES, COUNT_BITS, sizes, +1)
