"""ptrain.data: JSONL / ArrayRecord prompt streams, mixtures, shards, exact resume."""

import json
import logging

import pytest

from ptrain import data


def write_jsonl(path, records, extra_lines=()):
    lines = [json.dumps(r) for r in records]
    for lineno, text in extra_lines:  # (1-based line number, raw text) inserted as is
        lines.insert(lineno - 1, text)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def ids(batches):
    return [r["id"] for batch in batches for r in batch]


def take(it, n):
    return [next(it) for _ in range(n)]


@pytest.fixture
def ten(tmp_path):
    return write_jsonl(tmp_path / "ten.jsonl", [{"id": i, "prompt": f"p{i}"} for i in range(10)])


def test_epochs_cover_every_record_reshuffled_by_seed(ten):
    def stream(seed, n_batches=4):
        prompts = data.prompt_batches([ten], batch_size=5, seed=seed, process_index=0,
                                      process_count=1)
        return ids(take(prompts.iterator(), n_batches))

    first = stream(seed=0)
    assert sorted(first[:10]) == list(range(10)) and sorted(first[10:]) == list(range(10))
    assert first[:10] != first[10:]  # reshuffled for the second epoch
    assert stream(seed=0) == first and stream(seed=1) != first
    assert isinstance(next(data.prompt_batches([ten], batch_size=2, seed=0, process_index=0,
                                               process_count=1).iterator())[0], dict)


def test_malformed_lines_raise_with_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"id": i, "prompt": "p"} for i in range(4)],
                       extra_lines=[(3, '{"id": 99, "prompt": oops}')])
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: not valid JSON.*on_error='skip'"):
        data.prompt_batches([path], batch_size=2, seed=0, process_index=0, process_count=1)


def test_malformed_lines_skipped_are_counted_and_logged(tmp_path, caplog):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"id": i, "prompt": "p"} for i in range(5)],
                       extra_lines=[(2, "[1, 2]"), (4, "not json"), (6, ""),
                                    (8, '{"id": 7}')])
    with caplog.at_level(logging.WARNING):
        with pytest.raises(ValueError, match="on_error"):
            data.prompt_batches([path], batch_size=5, seed=0, on_error="ignore",
                                process_index=0, process_count=1)
        prompts = data.prompt_batches([path], batch_size=5, seed=0, on_error="skip",
                                      required_keys=["prompt"], process_index=0,
                                      process_count=1)
    # Line 6 is blank (not a record); 2, 4 and 8 are malformed.
    assert prompts.metrics() == {"data/records": 5, "data/malformed": 3}
    assert [m.split(": ")[0].rsplit(":", 1)[1] for m in prompts.sources[0].malformed] == \
        ["2", "4", "8"]
    assert "missing required keys ['prompt']" in prompts.sources[0].malformed[2]
    assert sum("bad.jsonl:4" in r.getMessage() for r in caplog.records) == 1
    assert sorted(ids(take(prompts.iterator(), 1))) == list(range(5))


def test_mixture_follows_weights(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"id": f"a{i}"} for i in range(7)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"id": f"b{i}"} for i in range(5)])
    prompts = data.prompt_batches([(a, 3.0), (b, 1.0)], batch_size=40, seed=3,
                                  process_index=0, process_count=1)
    got = ids(take(prompts.iterator(), 10))
    n_a = sum(x.startswith("a") for x in got)
    assert abs(n_a - 300) <= 2, n_a
    with pytest.raises(ValueError, match="weights must be positive"):
        data.prompt_batches([(a, 1.0), (b, 0.0)], batch_size=4, seed=0, process_index=0,
                            process_count=1)


def test_hosts_hold_their_slice_of_each_global_batch(ten):
    def stream(index, count, batch_size, num_epochs=None):
        prompts = data.prompt_batches([ten], batch_size=batch_size, seed=5, process_index=index,
                                      process_count=count, num_epochs=num_epochs)
        return [ids([b]) for b in prompts.iterator()] if num_epochs else \
            [ids([b]) for b in take(prompts.iterator(), 3)]

    whole = stream(0, 1, 6)  # one host, global batches of 6
    for count, size in [(2, 3), (3, 2)]:
        hosts = [stream(i, count, size) for i in range(count)]
        for k in range(3):  # host i holds rows i*size .. of global batch k, in order
            assert sum((h[k] for h in hosts), []) == whole[k]
    # A finite stream: 10 records x 2 epochs = 6 slices of 3 = 3 global batches of 2 hosts...
    assert [len(stream(i, 2, 3, num_epochs=2)) for i in range(2)] == [3, 3]
    # ... and of 4 hosts: 6 slices make one whole global batch of 4; the rest is dropped.
    assert [len(stream(i, 4, 3, num_epochs=2)) for i in range(4)] == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="process_index"):
        stream(2, 2, 3)


def test_iterator_state_resumes_exactly_after_restart(tmp_path, ten):
    other = write_jsonl(tmp_path / "o.jsonl", [{"id": 100 + i} for i in range(3)])

    def build():  # a fresh process re-opens the files
        return data.prompt_batches([(ten, 2.0), (other, 1.0)], batch_size=4, seed=11,
                                   process_index=0, process_count=1)

    it = build().iterator()
    take(it, 3)
    state = json.loads(json.dumps(it.get_state()))
    expected = ids(take(it, 5))
    assert ids(take(build().iterator(state), 5)) == expected
    assert ids(take(build().iterator(), 5)) != expected


def test_array_record_source(tmp_path):
    from array_record.python import array_record_module

    path = str(tmp_path / "p.array_record")
    writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
    for i in range(6):
        writer.write(json.dumps({"id": i}).encode() if i != 2 else b"\xff garbage")
    writer.close()
    with pytest.raises(ValueError, match=r"p\.array_record:record 2: not valid JSON"):
        data.prompt_batches([path], batch_size=5, seed=0, process_index=0, process_count=1)
    prompts = data.prompt_batches([path], batch_size=5, seed=0, on_error="skip",
                                  process_index=0, process_count=1)
    assert prompts.num_malformed == 1
    assert sorted(ids(take(prompts.iterator(), 1))) == [0, 1, 3, 4, 5]


def test_records_in_memory_stream_as_the_file_written_from_them(tmp_path):
    """The closed loop's prompt stream serves its Tasks as they are: a mixture over lists in
    memory yields the objects in the order the files written from them would, and its
    iterator state resumes the file stream exactly (and the other way round)."""
    from ptrain import tasks

    def task(i, domain):
        return tasks.Task(f"{domain}{i}", domain, tasks.Answer(str(i), numeric=True),
                          prompt=f"{domain}: {i} = ?\n")

    code, arith = [task(i, "code") for i in range(7)], [task(i, "arith") for i in range(4)]
    files = [str(tmp_path / "code.jsonl"), str(tmp_path / "arith.jsonl")]
    tasks.write_jsonl(code, files[0])
    tasks.write_jsonl(arith, files[1])

    def build(sources):
        return data.prompt_batches(list(zip(sources, (2.0, 1.0))), batch_size=3, seed=5,
                                   process_index=0, process_count=1)

    def task_ids(batches):
        return [r.id if isinstance(r, tasks.Task) else r["id"] for b in batches for r in b]

    in_memory, on_disk = build([code, arith]).iterator(), build(files).iterator()
    first = take(in_memory, 4)
    assert all(isinstance(r, tasks.Task) for b in first for r in b)
    assert task_ids(first) == task_ids(take(on_disk, 4))
    assert [tasks.to_record(r) for b in first for r in b][:3] == \
        [tasks.to_record(tasks.from_record(r)) for r in next(build(files).iterator())]
    state = json.loads(json.dumps(in_memory.get_state()))
    assert state == json.loads(json.dumps(on_disk.get_state()))
    expected = task_ids(take(in_memory, 5))
    assert task_ids(take(build(files).iterator(state), 5)) == expected
    assert task_ids(take(build([code, arith]).iterator(state), 5)) == expected
