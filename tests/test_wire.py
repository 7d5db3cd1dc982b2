"""The envelope codec and body accessors: exact round trips, and nothing but ProtocolError
for untrusted input (wire layer; pure and fast)."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest

from dsml import ProtocolError
from dsml.wire import (
    MAX_ENVELOPE_BYTES,
    PROTOCOL_VERSION,
    Envelope,
    Fields,
    Fingerprint,
    Kind,
    decode,
    encode,
)

FULL = Fingerprint("all_reduce", "float32", 8, (2, 4), "sum", 0, "ring")
BODY = {"reason": "timeout", "ranks": [1, 2], "nested": {"ok": True}, "blob": b"\x00\x01"}
I64_MAX = (1 << 63) - 1


def pack(*items: Any) -> bytes:
    return msgpack.packb(list(items), use_bin_type=True)


def raw_envelope(**changes: Any) -> list[Any]:
    """The wire items of a valid envelope, with some replaced."""
    items = {
        "version": PROTOCOL_VERSION,
        "kind": int(Kind.CHUNK),
        "epoch": 1,
        "src": 0,
        "cid": 1,
        "step": 0,
        "chunk": 0,
        "fp": FULL.to_wire(),
        "body": None,
    }
    items.update(changes)
    return list(items.values())


def assert_round_trip(env: Envelope) -> Envelope:
    back = decode(encode(env))
    assert back == env
    assert back.body == env.body  # compared on its own: not every Envelope version compares it
    assert type(back.kind) is Kind
    return back


# -- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
@pytest.mark.parametrize("fingerprint", [None, Fingerprint("barrier"), FULL])
@pytest.mark.parametrize("body", [None, {}, BODY])
def test_every_kind_round_trips_with_and_without_fingerprint_and_body(kind, fingerprint, body):
    env = Envelope(kind, 7, 3, 42, 5, 2, fingerprint, body)
    back = assert_round_trip(env)
    assert (back.epoch, back.src, back.cid, back.step, back.chunk) == (7, 3, 42, 5, 2)


def test_extreme_but_legal_integers_round_trip():
    fp = Fingerprint("send", "int8", I64_MAX, (0,) * 64, root=I64_MAX)
    assert_round_trip(Envelope(Kind.PEER_MESSAGE, I64_MAX, -1, I64_MAX, I64_MAX, I64_MAX, fp))
    assert_round_trip(Envelope(Kind.HEARTBEAT))


def test_a_zero_dimensional_shape_stays_a_tuple_after_a_round_trip():
    back = assert_round_trip(Envelope(Kind.PEER_MESSAGE, fingerprint=Fingerprint("send", shape=())))
    assert back.fingerprint is not None
    assert back.fingerprint.shape == ()


def test_decode_accepts_a_memoryview():
    env = Envelope(Kind.CHUNK, 1, 0, 1, fingerprint=FULL)
    assert decode(memoryview(encode(env))) == env


# -- fingerprints --------------------------------------------------------------------------


def test_fingerprints_with_unknown_fields_never_conflict_on_them():
    vague = Fingerprint("all_reduce")
    assert vague.conflicts(FULL) == []
    assert FULL.conflicts(vague) == []
    assert FULL.conflicts(FULL) == []
    partly = Fingerprint("all_reduce", dtype="float32", shape=None, op="sum")
    assert partly.conflicts(FULL) == []


def test_conflicts_lists_exactly_the_known_fields_that_differ_in_declaration_order():
    other = Fingerprint("all_reduce", "float64", 8, (8,), "max", None, "ring")
    assert FULL.conflicts(other) == ["dtype", "shape", "op"]
    assert other.conflicts(FULL) == ["dtype", "shape", "op"]
    everything = Fingerprint("broadcast", "int8", 9, (9,), "min", 1, "tree")
    assert FULL.conflicts(everything) == [
        "collective",
        "dtype",
        "count",
        "shape",
        "op",
        "root",
        "algorithm",
    ]


def test_a_root_of_zero_is_known_and_conflicts_with_another_root():
    assert Fingerprint("reduce", root=0).conflicts(Fingerprint("reduce", root=1)) == ["root"]


@pytest.mark.parametrize(
    ("fingerprint", "text"),
    [
        (FULL, "all_reduce(float32, shape=(2, 4), op=sum, root=0, algorithm=ring)"),
        (Fingerprint("barrier"), "barrier()"),
        (
            Fingerprint("reduce", "int64", 5, None, "max", 2),
            "reduce(int64, count=5, op=max, root=2)",
        ),
        (Fingerprint("all_gather", "float32", 12, (3, 4)), "all_gather(float32, shape=(*, 3, 4))"),
        (Fingerprint("gather", "int8", 4, ()), "gather(int8, shape=(*))"),
        (Fingerprint("scatter", root=1), "scatter(root=1)"),
    ],
)
def test_describe_reads_like_the_call(fingerprint, text):
    assert fingerprint.describe() == text


# -- untrusted input -----------------------------------------------------------------------


def assert_only_protocol_errors(data: bytes) -> None:
    try:
        env = decode(data)
    except ProtocolError:
        return
    assert isinstance(env, Envelope)  # decoding garbage into a valid envelope is allowed


def test_random_bytes_raise_nothing_but_protocol_error(seed):
    rng = random.Random(seed)
    valid = encode(Envelope(Kind.CHUNK, 1, 0, 1, 0, 0, FULL, BODY))
    refused = 0
    for _ in range(10_000):
        data = rng.randbytes(rng.randrange(0, 80))
        assert_only_protocol_errors(data)
        mutated = bytearray(valid)
        for _ in range(rng.randrange(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        assert_only_protocol_errors(bytes(mutated))
        try:
            decode(rng.choice([b"\x99", b"\xdc\xff\xff", b"\xdd"]) + data)
        except ProtocolError:
            refused += 1
    assert refused > 9900  # array headers over garbage almost never decode


def test_every_truncation_of_a_valid_envelope_is_refused():
    data = encode(Envelope(Kind.ABORT, 3, 1, 9, 2, 1, FULL, BODY))
    for end in range(len(data)):
        with pytest.raises(ProtocolError):
            decode(data[:end])


@pytest.mark.parametrize(
    "items",
    [
        pytest.param(raw_envelope()[:8], id="eight items"),
        pytest.param([*raw_envelope(), None], id="ten items"),
        pytest.param(raw_envelope(version=2), id="version 2"),
        pytest.param(raw_envelope(version=0), id="version 0"),
        pytest.param(raw_envelope(version=True), id="version true"),
        pytest.param(raw_envelope(version=1.0), id="version float"),
        pytest.param(raw_envelope(version="1"), id="version string"),
        pytest.param(raw_envelope(kind=99), id="unknown kind"),
        pytest.param(raw_envelope(kind=0), id="kind zero"),
        pytest.param(raw_envelope(kind=True), id="kind bool"),
        pytest.param(raw_envelope(kind=20.0), id="kind float"),
        pytest.param(raw_envelope(kind="CHUNK"), id="kind name"),
        pytest.param(raw_envelope(epoch=-1), id="negative epoch"),
        pytest.param(raw_envelope(epoch=1 << 63), id="epoch 2**63"),
        pytest.param(raw_envelope(epoch=(1 << 64) - 1), id="epoch uint64 max"),
        pytest.param(raw_envelope(epoch=True), id="epoch bool"),
        pytest.param(raw_envelope(epoch=1.5), id="epoch float"),
        pytest.param(raw_envelope(src=-2), id="src -2"),
        pytest.param(raw_envelope(src=False), id="src bool"),
        pytest.param(raw_envelope(cid=-1), id="negative cid"),
        pytest.param(raw_envelope(cid=None), id="cid nil"),
        pytest.param(raw_envelope(step=b"\x01"), id="step bytes"),
        pytest.param(raw_envelope(chunk=[0]), id="chunk list"),
        pytest.param(raw_envelope(body=[1, 2]), id="body list"),
        pytest.param(raw_envelope(body="text"), id="body string"),
        pytest.param(raw_envelope(body=7), id="body int"),
        pytest.param(raw_envelope(fp="all_reduce"), id="fingerprint string"),
        pytest.param(raw_envelope(fp={"collective": "x"}), id="fingerprint map"),
        pytest.param(raw_envelope(fp=FULL.to_wire()[:7]), id="fingerprint of 7 items"),
        pytest.param(raw_envelope(fp=[*FULL.to_wire(), None]), id="fingerprint of 9 items"),
        pytest.param(raw_envelope(fp=[None] * 8), id="fingerprint without collective"),
        pytest.param(raw_envelope(fp=["", *[None] * 7]), id="empty collective"),
        pytest.param(raw_envelope(fp=["x" * 65, *[None] * 7]), id="collective too long"),
        pytest.param(raw_envelope(fp=["x", "d" * 65, *[None] * 6]), id="dtype too long"),
        pytest.param(raw_envelope(fp=["x", 7, *[None] * 6]), id="dtype int"),
        pytest.param(raw_envelope(fp=["x", None, -1, *[None] * 5]), id="negative count"),
        pytest.param(raw_envelope(fp=["x", None, True, *[None] * 5]), id="count bool"),
        pytest.param(raw_envelope(fp=["x", None, 1 << 63, *[None] * 5]), id="count huge"),
        pytest.param(
            raw_envelope(fp=["x", None, None, [1] * 65, None, None, None, None]), id="65 dims"
        ),
        pytest.param(
            raw_envelope(fp=["x", None, None, [1, -1], None, None, None, None]), id="dim -1"
        ),
        pytest.param(
            raw_envelope(fp=["x", None, None, [1.0], None, None, None, None]), id="dim float"
        ),
        pytest.param(
            raw_envelope(fp=["x", None, None, [True], None, None, None, None]), id="dim bool"
        ),
        pytest.param(raw_envelope(fp=["x", None, None, 8, None, None, None, None]), id="shape int"),
        pytest.param(
            raw_envelope(fp=["x", None, None, {"a": 1}, None, None, None, None]), id="shape map"
        ),
        pytest.param(
            raw_envelope(fp=["x", None, None, None, b"sum", None, None, None]), id="op bytes"
        ),
        pytest.param(raw_envelope(fp=["x", None, None, None, None, -1, None, None]), id="root -1"),
        pytest.param(
            raw_envelope(fp=["x", None, None, None, None, None, 3, None]), id="algorithm int"
        ),
        pytest.param(raw_envelope(fp=["x", *[None] * 6, -4096]), id="chunk_bytes negative"),
        pytest.param(raw_envelope(fp=["x", *[None] * 6, "4M"]), id="chunk_bytes string"),
        pytest.param({"version": 1}, id="a map"),
        pytest.param("envelope", id="a string"),
        pytest.param(1, id="an int"),
        pytest.param(None, id="nil"),
        pytest.param([], id="empty array"),
    ],
)
def test_valid_msgpack_of_the_wrong_shape_is_refused(items):
    data = msgpack.packb(items, use_bin_type=True)
    with pytest.raises(ProtocolError):
        decode(data)


VALID_FP = ["all_reduce", "float32", 1, [1], "sum", 0, "ring", 4096]


@pytest.mark.parametrize(
    ("index", "value"),
    [
        pytest.param(2, True, id="count bool"),
        pytest.param(2, 1.0, id="count float"),
        pytest.param(3, [True], id="dim bool"),
        pytest.param(3, [1.0], id="dim float"),
        pytest.param(5, False, id="root bool"),
        pytest.param(5, 0.0, id="root float"),
    ],
)
def test_a_wrongly_typed_fingerprint_is_refused_even_after_its_valid_twin_was_seen(index, value):
    # True == 1 and 1.0 == 1 in Python (with equal hashes): a decoder that remembers
    # fingerprints it has seen must not let an equal-but-wrongly-typed one through.
    assert decode(pack(*raw_envelope(fp=VALID_FP))).fingerprint is not None
    bad = list(VALID_FP)
    bad[index] = value
    with pytest.raises(ProtocolError):
        decode(pack(*raw_envelope(fp=bad)))


def test_a_string_longer_than_the_limit_is_refused():
    data = pack(*raw_envelope(body={"text": "x" * 2000}))
    assert decode(data, max_bytes=4096).body == {"text": "x" * 2000}
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(data, max_bytes=1024)


def test_nesting_deeper_than_msgpack_allows_is_refused():
    deep = b"\x91" * 5000 + b"\xc0"  # 5000 nested one-item arrays
    head = b"\x99" + b"".join(msgpack.packb(v) for v in raw_envelope()[:8])
    data = head + b"\x81\xa1k" + deep  # the body {"k": [[[...]]]}
    with pytest.raises(ProtocolError):
        decode(data)
    with pytest.raises(ProtocolError):
        decode(deep)


def test_map_keys_that_are_not_strings_are_refused():
    data = b"\x99" + b"".join(msgpack.packb(v) for v in raw_envelope()[:8]) + b"\x81\x01\x02"
    with pytest.raises(ProtocolError):
        decode(data)


@pytest.mark.parametrize(
    "ext",
    [
        msgpack.ExtType(5, b"payload"),
        msgpack.Timestamp(0, 0),  # ext type -1
        msgpack.ExtType(1, b"\x00" * 16),
    ],
    ids=["app ext", "timestamp", "fixext 16"],
)
def test_extension_types_are_refused_anywhere(ext):
    for slot in ("epoch", "body", "fp"):
        value = {"x": ext} if slot == "body" else ext
        data = msgpack.packb(raw_envelope(**{slot: value}), use_bin_type=True)
        with pytest.raises(ProtocolError):
            decode(data)


def test_an_envelope_larger_than_the_limit_is_refused_before_parsing():
    body = {"pad": b"\x00" * MAX_ENVELOPE_BYTES}
    data = encode(Envelope(Kind.CHUNK, body=body))
    assert len(data) > MAX_ENVELOPE_BYTES
    with pytest.raises(ProtocolError, match=f"{MAX_ENVELOPE_BYTES}-byte limit"):
        decode(data)
    assert decode(data, max_bytes=len(data)).body == body


def test_trailing_bytes_after_an_envelope_are_refused():
    data = encode(Envelope(Kind.CHUNK, 1, fingerprint=FULL))
    with pytest.raises(ProtocolError):
        decode(data + b"\xc0")


# -- Fields --------------------------------------------------------------------------------

FIELDS = Fields(
    {
        "n": 5,
        "neg": -3,
        "big": 1 << 63,
        "flag": True,
        "name": "abc",
        "f": 1.5,
        "ints": [1, 2, 3],
        "maps": [{"a": 1}, {"a": 2}],
        "map": {"inner": 7},
        "none": None,
        "bytes": b"abc",
    },
    "Test",
)


def test_fields_return_values_of_the_right_type_and_range():
    assert FIELDS.get_int("n") == 5
    assert FIELDS.get_int("neg", lo=-5) == -3
    assert FIELDS.get_int("absent", optional=True) is None
    assert FIELDS.get_str("name") == "abc"
    assert FIELDS.get_str("absent", optional=True) is None
    assert FIELDS.get_bool("flag") is True
    assert FIELDS.int_list("ints") == [1, 2, 3]
    assert [m.get_int("a") for m in FIELDS.map_list("maps")] == [1, 2]
    assert FIELDS.get_map("map").get_int("inner") == 7
    assert Fields(None, "Empty").get_int("x", optional=True) is None


@pytest.mark.parametrize(
    "read",
    [
        pytest.param(lambda f: f.get_int("absent"), id="missing int"),
        pytest.param(lambda f: f.get_int("flag"), id="bool as int"),
        pytest.param(lambda f: f.get_int("f"), id="float as int"),
        pytest.param(lambda f: f.get_int("name"), id="string as int"),
        pytest.param(lambda f: f.get_int("none"), id="nil as int"),
        pytest.param(lambda f: f.get_int("neg"), id="below lo"),
        pytest.param(lambda f: f.get_int("n", hi=4), id="above hi"),
        pytest.param(lambda f: f.get_int("big"), id="above int64"),
        pytest.param(lambda f: f.get_str("absent"), id="missing string"),
        pytest.param(lambda f: f.get_str("n"), id="int as string"),
        pytest.param(lambda f: f.get_str("bytes"), id="bytes as string"),
        pytest.param(lambda f: f.get_str("name", max_len=2), id="string too long"),
        pytest.param(lambda f: f.get_bool("n"), id="int as bool"),
        pytest.param(lambda f: f.get_bool("absent"), id="missing bool"),
        pytest.param(lambda f: f.int_list("n"), id="int as list"),
        pytest.param(lambda f: f.int_list("ints", max_len=2), id="list too long"),
        pytest.param(lambda f: f.int_list("ints", hi=2), id="list item above hi"),
        pytest.param(lambda f: f.int_list("maps"), id="maps as int list"),
        pytest.param(lambda f: f.map_list("ints"), id="ints as map list"),
        pytest.param(lambda f: f.map_list("map"), id="map as map list"),
        pytest.param(lambda f: f.map_list("maps", max_len=1), id="map list too long"),
        pytest.param(lambda f: f.get_map("n"), id="int as map"),
        pytest.param(lambda f: f.get_map("ints"), id="list as map"),
        pytest.param(lambda f: f.get_map("absent"), id="missing map"),
        pytest.param(lambda f: f.get_map("map").get_str("inner"), id="nested wrong type"),
    ],
)
def test_fields_reject_wrong_types_and_ranges_with_protocol_error(read):
    with pytest.raises(ProtocolError, match="Test"):
        read(FIELDS)


@pytest.mark.parametrize("body", [[1, 2], "text", 5, b"bytes"])
def test_a_body_that_is_not_a_map_is_refused(body):
    with pytest.raises(ProtocolError, match="body must be a map"):
        Fields(body, "Test")


def test_a_list_of_maps_with_one_non_map_is_refused():
    with pytest.raises(ProtocolError, match=r"Test.items\[1\]"):
        Fields({"items": [{}, 3]}, "Test").map_list("items")
