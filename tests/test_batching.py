"""Dynamic batching: rows merged and padded to the longest sequence (not max_len), split back; concurrent requests
through the real service give the same logits as single ones and as bare ONNX Runtime."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from serving import bare_logits, deploy

from service import batching

NAME = "mha-h4-d32"


def _rows(seed: int, n: int, length: int, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """n rows of `length` tokens, padded to `width` columns: ids and mask, each (n, width)."""
    width = width or length
    ids = np.zeros((n, width), dtype=np.int64)
    ids[:, :length] = np.random.default_rng(seed).integers(4, 260, size=(n, length))
    mask = (ids != 0).astype(np.int64)
    return ids, mask


def test_merge_pads_to_the_longest_sequence_and_drops_all_padding_columns():
    a = _rows(0, 2, 3, width=10)  # 7 trailing padding columns
    b = _rows(1, 1, 5)
    ids, mask, rows = batching.merge([a, b])
    assert ids.shape == mask.shape == (3, 5) and rows == [2, 1]
    np.testing.assert_array_equal(ids[:2, :3], a[0][:, :3])
    np.testing.assert_array_equal(ids[2], b[0][0])
    assert mask[:2, 3:].sum() == 0 and ids[:2, 3:].sum() == 0


def test_split_returns_each_requests_rows_in_order():
    logits = np.arange(12, dtype=np.float32).reshape(6, 2)  # (N, C)
    parts = batching.split(logits, [1, 3, 2])
    assert [p.shape for p in parts] == [(1, 2), (3, 2), (2, 2)]
    np.testing.assert_array_equal(np.concatenate(parts), logits)
    with pytest.raises(ValueError, match="6 rows, the batch had 5"):
        batching.split(logits, [2, 3])


def test_a_merged_batch_gives_each_request_its_own_logits(tiny_models_dir):
    requests = [_rows(s, n, t) for s, (n, t) in enumerate([(1, 4), (3, 9), (2, 1)])]
    ids, mask, rows = batching.merge(requests)
    merged = batching.split(bare_logits(tiny_models_dir, NAME, ids, mask), rows)
    for (r_ids, r_mask), got in zip(requests, merged, strict=True):
        np.testing.assert_allclose(got, bare_logits(tiny_models_dir, NAME, r_ids, r_mask), atol=1e-5)


@pytest.fixture(scope="module")
def batched_service(serve_port, tiny_models_dir):
    """The service with a batch window long enough that concurrent requests surely share ORT runs (without
    ingress coalescing: each request is its own call, batched in the replica)."""
    settings = {"num_cpus": 0.1, "max_batch_size": 64, "batch_wait_timeout_s": 0.2, "max_ongoing_requests": 32}
    return deploy(serve_port, "batched", tiny_models_dir, models=[NAME], deployment=settings)


@pytest.mark.serve
def test_concurrent_requests_share_batches_and_match_single_requests_and_bare_ort(batched_service, service):
    requests = [_rows(100 + i, 1 + i % 3, 2 + 3 * i) for i in range(8)]  # different rows and lengths

    def predict(base, ids_mask):
        ids, mask = ids_mask
        body = {"input_ids": ids.tolist(), "attention_mask": mask.tolist()}
        with base.client() as c:
            return c.post(f"/v1/models/{NAME}/predict", json=body).json()

    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda r: predict(batched_service, r), requests))
    alone = [predict(service, r) for r in requests]
    assert max(out["timing"]["batch_rows"] for out in together) > 3, "concurrent requests should share an ORT run"
    for (ids, mask), t, a in zip(requests, together, alone, strict=True):
        expected = bare_logits(batched_service.models_dir, NAME, ids, mask)
        np.testing.assert_allclose(np.asarray(t["logits"], dtype=np.float32), expected, atol=1e-5)
        np.testing.assert_allclose(np.asarray(a["logits"], dtype=np.float32), expected, atol=1e-5)


@pytest.mark.serve
def test_a_request_with_more_rows_than_max_batch_size_is_split_and_answered_in_order(service, tiny_models_dir):
    max_batch = service.config["deployment"]["max_batch_size"]
    ids, mask = _rows(7, max_batch * 2 + 3, 11)  # (2 * max_batch + 3, 11): three chunks
    body = {"input_ids": ids.tolist(), "attention_mask": mask.tolist()}
    with service.client() as client:
        response = client.post(f"/v1/models/{NAME}/predict", json=body)
    assert response.status_code == 200, response.text
    np.testing.assert_allclose(response.json()["logits"], bare_logits(tiny_models_dir, NAME, ids, mask), atol=1e-5)


@pytest.fixture(scope="module")
def two_run_service(serve_port, tiny_models_dir):
    """The model on two ORT threads, so two runs may be in flight at once (the default on CPU): a run that starts
    alone has both threads, runs side by side have one each (a second session of the same file)."""
    settings = {"num_cpus": 0.1, "intra_op_threads": 2, "light_model_threads": None, "max_batch_size": 4}
    settings["max_ongoing_requests"] = 64  # a tiny model is light: light_model_threads None keeps it on both threads
    return deploy(serve_port, "two-runs", tiny_models_dir, models=[NAME], deployment=settings)


@pytest.mark.serve
def test_runs_side_by_side_on_one_thread_each_answer_as_a_lone_run_on_two_threads_does(two_run_service):
    requests = [_rows(200 + i, 1 + i % 4, 3 + i) for i in range(24)]  # more rows than one batch holds at once

    def predict(ids_mask):
        ids, mask = ids_mask
        body = {"input_ids": ids.tolist(), "attention_mask": mask.tolist()}
        with two_run_service.client() as c:
            return c.post(f"/v1/models/{NAME}/predict", json=body).json()

    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(predict, requests))
    lone = [predict(r) for r in requests]  # one at a time: every run alone, on both threads
    with two_run_service.client() as c:
        (model,) = c.get("/v1/models").json()["models"]
    assert model["threads"] == 2
    for (ids, mask), t, a in zip(requests, together, lone, strict=True):
        expected = bare_logits(two_run_service.models_dir, NAME, ids, mask)
        np.testing.assert_allclose(np.asarray(t["logits"], dtype=np.float32), expected, atol=1e-5)
        np.testing.assert_allclose(np.asarray(a["logits"], dtype=np.float32), expected, atol=1e-5)
