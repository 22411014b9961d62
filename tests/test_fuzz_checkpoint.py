"""Fuzzing the safetensors header and index reader: over mutated files the only outcomes are a
load whose every tensor equals what safetensors itself reads, or an hf_parallel error naming the
checkpoint. Never another exception, never a hang (each attempt runs under an alarm)."""

import json
import os
import shutil
import signal
import tempfile
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import hf_parallel
from hf_parallel import CheckpointError
from hf_parallel.checkpoint.files import INDEX_FILE
from hf_parallel.checkpoint.loading import checkpoint_files

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # examples: conftest's profile
HANG_SECONDS = 60

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
dtypes = st.sampled_from(["F32", "F16", "BF16", "F64", "F8_E4M3", "I32", "I64", "U8", "BOOL", "X9", ""])
shapes = st.lists(st.integers(-3, 2**40), max_size=4) | st.lists(st.integers(0, 128), max_size=3)


def _alarm(signum, frame):
    raise TimeoutError(f"a load of a mutated checkpoint took more than {HANG_SECONDS} s")


def attempt(directory: str) -> None:
    """Load ``directory``: success must reproduce the file's tensors, failure must be ours and name it."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(HANG_SECONDS)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = hf_parallel.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    except CheckpointError as error:
        assert os.path.realpath(directory) in str(error) or directory in str(error), str(error)
        return
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    files = checkpoint_files(directory)
    state = hf_parallel.parallel_state(model)
    for entry in state.layout.unique_params():
        key = state.source_keys[entry.name]
        with safe_open(files[key], framework="pt") as f:
            want = f.get_tensor(key).to(torch.float32)
        assert torch.equal(model.get_parameter(entry.name), want), entry.name


def split_file(data: bytes):
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def join_file(header, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + body


header_edits = st.one_of(
    st.tuples(st.just("dtype"), dtypes),
    st.tuples(st.just("shape"), shapes | json_values),
    st.tuples(st.just("data_offsets"), st.lists(st.integers(-3, 2**40), max_size=3) | json_values),
    st.tuples(st.just("delete"), st.none()),
    st.tuples(st.just("rename"), st.text(max_size=20)),
    st.tuples(st.just("__metadata__"), json_values),
)


@pytest.fixture(scope="module")
def single_file(tiny_paths):
    return tiny_paths["llama"]


@pytest.fixture(scope="module")
def sharded(tiny_paths, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fuzz") / "sharded")
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(tiny_paths["llama"])
    model.save_pretrained(out, max_shard_size="40KB")
    return out


def mutated_copy(source: str, edit) -> tempfile.TemporaryDirectory:
    scratch = tempfile.TemporaryDirectory(prefix="fuzz-")
    target = os.path.join(scratch.name, "ckpt")
    shutil.copytree(source, target)
    edit(target)
    return scratch


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), header_edits), min_size=1, max_size=3))
def test_mutated_header_fields(single_file, edits):
    def edit(target):
        file = os.path.join(target, "model.safetensors")
        with open(file, "rb") as f:
            header, body = split_file(f.read())
        for which, (field, value) in edits:
            names = sorted(k for k in header if k != "__metadata__")
            name = names[which % len(names)]
            if field == "delete":
                del header[name]
            elif field == "rename":
                header[value] = header.pop(name)
            elif field == "__metadata__":
                header["__metadata__"] = value
            else:
                header[name][field] = value
        with open(file, "wb") as f:
            f.write(join_file(header, body))

    with mutated_copy(single_file, edit) as scratch:
        attempt(os.path.join(scratch, "ckpt"))


@FUZZ
@given(data=st.data())
def test_mutated_bytes_and_truncation(single_file, data):
    with open(os.path.join(single_file, "model.safetensors"), "rb") as f:
        original = f.read()
    header_end = 8 + int.from_bytes(original[:8], "little")
    if data.draw(st.booleans(), label="truncate"):
        mutated = original[: data.draw(st.integers(0, len(original) - 1), label="length")]
    else:
        mutated = bytearray(original)
        for _ in range(data.draw(st.integers(1, 8), label="flips")):
            mutated[data.draw(st.integers(0, header_end - 1), label="at")] = data.draw(st.integers(0, 255))
        mutated = bytes(mutated)

    def edit(target):
        with open(os.path.join(target, "model.safetensors"), "wb") as f:
            f.write(mutated)

    with mutated_copy(single_file, edit) as scratch:
        attempt(os.path.join(scratch, "ckpt"))


index_values = st.one_of(
    st.sampled_from(["../x.safetensors", "/etc/passwd", "", ".", "sub/x", "model.safetensors", "a\0b"]),
    st.text(max_size=30),
    json_values,
)


@FUZZ
@given(
    data=st.data(),
    whole=st.none() | st.binary(max_size=64) | json_values.map(lambda v: json.dumps({"weight_map": v}).encode()),
)
def test_mutated_index(sharded, data, whole):
    with open(os.path.join(sharded, INDEX_FILE)) as f:
        index = json.load(f)
    keys = sorted(index["weight_map"])
    files = sorted(set(index["weight_map"].values()))
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        key = keys[data.draw(st.integers(0, len(keys) - 1), label="key")]
        choice = data.draw(st.sampled_from(["value", "other file", "delete", "add"]), label="edit")
        if choice == "value":
            index["weight_map"][key] = data.draw(index_values, label="value")
        elif choice == "other file":
            index["weight_map"][key] = data.draw(st.sampled_from(files), label="file")
        elif choice == "delete":
            index["weight_map"].pop(key, None)
        else:
            index["weight_map"][data.draw(st.text(max_size=12), label="new key")] = data.draw(index_values)
    raw = whole if whole is not None else json.dumps(index).encode()

    def edit(target):
        with open(os.path.join(target, INDEX_FILE), "wb") as f:
            f.write(raw)

    with mutated_copy(sharded, edit) as scratch:
        attempt(os.path.join(scratch, "ckpt"))
