"""Long explanation jobs: the work a request may ask for is bounded (``WORK_BUDGET``), a
running job is cancelled at its next forward pass, and while it runs the other requests on
the same model are answered. No timing: the job is held inside its first forward pass by a
test hook (an Event), so "answered while it runs" is a fact, not a race."""
from __future__ import annotations

import threading

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

from captum_transformers.errors import InputError  # noqa: E402
from captum_transformers.explorer.app import create_app  # noqa: E402
from captum_transformers.explorer.method_arguments import WORK_BUDGET, check_work, request_work  # noqa: E402
from explorer_workspaces import image_workspace  # noqa: E402

TOKEN = "test-token-0123456789abcdef"
HEADERS = {"X-Explorer-Token": TOKEN}
IG = "integrated-gradients"


def client_for(workspace) -> TestClient:
    return TestClient(create_app(workspace, TOKEN, allowed_hosts=("testserver",), warm=False))


def test_the_work_of_a_request_is_bounded_by_one_budget():
    client = client_for(image_workspace(batch=4))
    response = client.post("/api/explain", headers=HEADERS, json={
        "methods": [{"name": IG, "arguments": {"n_steps": 1100}}], "targets": {str(i): 0 for i in range(4)}})
    assert response.status_code == 400, response.text
    assert "asks for 4400 model passes" in response.json()["error"]
    assert f"budget is {WORK_BUDGET} per request" in response.json()["error"]
    # the 10000-step request that ran for minutes: refused by the budget, on one example too
    response = client.post("/api/explain", headers=HEADERS, json={
        "methods": [{"name": IG, "arguments": {"n_steps": 10000}}], "targets": {"0": 0}})
    assert response.status_code == 400 and "n_steps" in response.json()["error"], response.text
    response = client.post("/api/curve", headers=HEADERS, json={
        "method": IG, "arguments": {"n_steps": WORK_BUDGET + 1}, "example": 0, "target": 0})
    assert response.status_code == 400, response.text


def test_work_is_examples_times_steps_summed_over_methods():
    requests = [(IG, {"n_steps": 1024}), ("rollout", {"head_fusion": "mean"})]
    assert request_work(requests, 4) == 4 * 1024 + 4
    check_work(requests[:1], 4)  # exactly the budget: accepted
    with pytest.raises(InputError, match="asks for 4100 model passes"):
        check_work(requests, 4)


def test_a_running_job_is_cancelled_and_other_requests_are_answered_meanwhile():
    workspace = image_workspace(batch=2)
    client = client_for(workspace)
    jobs = client.app.app.state.jobs
    entered, proceed, forwards = threading.Event(), threading.Event(), []

    def hold_the_first_forward(module, args):  # the test's own hook, on the model it built
        forwards.append(threading.current_thread().name)
        if len(forwards) == 1:
            entered.set()
            proceed.wait(30)

    handle = workspace.model.register_forward_pre_hook(hold_the_first_forward)
    try:
        # 2 examples x 200 steps in batches of 4 rows: 100 forward passes if nothing stops it
        response = client.post("/api/explain", headers=HEADERS, json={
            "methods": [{"name": IG, "arguments": {"n_steps": 200, "internal_batch_size": 4}}],
            "targets": {"0": 0, "1": 1}})
        assert response.status_code == 200, response.text
        long_job = response.json()["id"]
        assert entered.wait(30), "the job never ran its first forward pass"

        # the job is held inside its first forward pass: every answer below comes while it runs
        assert client.get("/api/session", headers=HEADERS).status_code == 200
        polled = client.get(f"/api/jobs/{long_job}", headers=HEADERS).json()
        assert polled["state"] == "running" and polled["running"] == IG
        queued = client.post("/api/explain", headers=HEADERS, json={
            "methods": [{"name": "rollout"}], "targets": {"0": 0}}).json()
        assert queued["state"] == "running" and queued["queued_behind"] == long_job
        busy = client.post("/api/curve", headers=HEADERS, json={
            "method": "saliency", "arguments": {}, "example": 0, "target": 0})
        assert busy.status_code == 409 and long_job in busy.json()["error"] and "Cancel" in busy.json()["error"]
        # a queued job is cancelled at once; the running one is asked to stop
        assert client.post(f"/api/jobs/{queued['id']}/cancel", headers=HEADERS, json={}).json()["state"] == "cancelled"
        asked = client.post(f"/api/jobs/{long_job}/cancel", headers=HEADERS, json={})
        assert asked.status_code == 200 and asked.json()["cancel_requested"] is True
        assert not proceed.is_set() and jobs.read(long_job)["state"] == "running"
    finally:
        proceed.set()
    try:
        state = jobs.wait(long_job, timeout=60)
        assert state["state"] == "cancelled" and state["results"] == [] and state["error"] is None
        assert len(forwards) == 1  # stopped at the next forward pass, not after 100
        assert workspace.cached(IG, {"n_steps": 200, "internal_batch_size": 4}, {0: 0, 1: 1}) == {}
        # the model is free again, and the cancel hook is gone from it
        done = client.post("/api/explain", headers=HEADERS, json={"methods": [{"name": "rollout"}],
                                                                   "targets": {"0": 0}}).json()
        assert jobs.wait(done["id"], timeout=60)["state"] == "done"
        assert len(workspace.model._forward_pre_hooks) == 1  # the test's own
    finally:
        handle.remove()


def test_cancelling_an_unknown_or_finished_job():
    client = client_for(image_workspace(batch=2))
    response = client.post("/api/jobs/job-999/cancel", headers=HEADERS, json={})
    assert response.status_code == 404 and "job-999" in response.json()["error"]
    done = client.post("/api/explain", headers=HEADERS, json={"methods": [{"name": "rollout"}],
                                                               "targets": {"0": 0}}).json()
    client.app.app.state.jobs.wait(done["id"], timeout=60)
    again = client.post(f"/api/jobs/{done['id']}/cancel", headers=HEADERS, json={}).json()
    assert again["state"] == "done" and len(again["results"]) == 1


def test_the_stop_check_changes_no_map():
    """Jobs run under the stop check (a torch-function mode); every method's maps equal the
    maps of the same workspace explained without it, exactly."""
    from captum_transformers.explorer.jobs import Jobs
    from captum_transformers.methods.catalog import METHOD_NAMES

    checked, plain = image_workspace(batch=2), image_workspace(batch=2)
    jobs = Jobs(checked)
    try:
        for method in METHOD_NAMES:
            state = jobs.wait(jobs.submit([(method, {})], {0: 1, 1: 3})["id"], timeout=120)
            assert state["state"] == "done", (method, state["error"])
            expected = plain.explain(method, {}, {0: 1, 1: 3})
            for index, found in state["results"][0]["maps"].items():
                assert found["values"] == expected[int(index)]["values"], method
    finally:
        jobs.close()


def test_unfinished_jobs_are_never_dropped_and_their_number_is_bounded():
    """Eviction drops only finished jobs: a running job submitted before ``KEPT_JOBS`` newer
    ones can still be polled and cancelled, and still makes curves 409. Past
    ``MAX_UNFINISHED_JOBS`` queued or running jobs a new one is refused (429); a request
    answered from the cache is not (it queues no work)."""
    from captum_transformers.explorer.jobs import KEPT_JOBS
    from captum_transformers.explorer.method_arguments import MAX_UNFINISHED_JOBS

    workspace = image_workspace(batch=2)
    client = client_for(workspace)
    jobs = client.app.app.state.jobs
    workspace.explain("rollout", {}, {0: 0})  # cached: answered at once, whatever runs
    entered, proceed, forwards = threading.Event(), threading.Event(), []

    def hold_the_first_forward(module, args):
        forwards.append(1)
        if len(forwards) == 1:
            entered.set()
            proceed.wait(30)

    def explain(methods, targets):
        return client.post("/api/explain", headers=HEADERS, json={"methods": methods, "targets": targets})

    handle = workspace.model.register_forward_pre_hook(hold_the_first_forward)
    unfinished = []
    try:
        response = explain([{"name": IG, "arguments": {"n_steps": 200, "internal_batch_size": 4}}], {"0": 0, "1": 1})
        long_job = response.json()["id"]
        unfinished.append(long_job)
        assert entered.wait(30), "the job never ran its first forward pass"
        for _ in range(MAX_UNFINISHED_JOBS - 1):  # queued behind the held job
            response = explain([{"name": "rollout"}], {"1": 1})
            assert response.status_code == 200 and response.json()["state"] == "running", response.text
            unfinished.append(response.json()["id"])

        refused = explain([{"name": "rollout"}], {"1": 2})
        assert refused.status_code == 429, refused.text
        message = refused.json()["error"]
        assert f"{MAX_UNFINISHED_JOBS} jobs of this model are unfinished" in message
        assert f"the limit is {MAX_UNFINISHED_JOBS}" in message and "Cancel one" in message and long_job in message

        # more than KEPT_JOBS jobs answered from the cache: accepted, and only finished ones are dropped
        answered = [explain([{"name": "rollout"}], {"0": 0}).json() for _ in range(KEPT_JOBS + 3)]
        assert all(job["state"] == "done" for job in answered)
        assert client.get(f"/api/jobs/{answered[0]['id']}", headers=HEADERS).status_code == 404
        assert client.get(f"/api/jobs/{answered[-1]['id']}", headers=HEADERS).json()["state"] == "done"
        for job_id in unfinished:
            assert client.get(f"/api/jobs/{job_id}", headers=HEADERS).json()["state"] == "running", job_id
        assert jobs.busy()["id"] == long_job
        busy = client.post("/api/curve", headers=HEADERS, json={
            "method": "saliency", "arguments": {}, "example": 0, "target": 0})
        assert busy.status_code == 409 and long_job in busy.json()["error"], busy.text

        # cancelling a queued job makes room for one more
        queued = unfinished.pop()
        assert client.post(f"/api/jobs/{queued}/cancel", headers=HEADERS, json={}).json()["state"] == "cancelled"
        response = explain([{"name": "rollout"}], {"1": 2})
        assert response.status_code == 200, response.text
        unfinished.append(response.json()["id"])
        assert explain([{"name": "rollout"}], {"1": 3}).status_code == 429
    finally:
        for job_id in unfinished:
            jobs.cancel(job_id)
        proceed.set()
    try:
        for job_id in unfinished:
            assert jobs.wait(job_id, timeout=60)["state"] == "cancelled", job_id
    finally:
        handle.remove()
        jobs.close()
