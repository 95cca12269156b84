"""The client against a real idem: a lost answer is repeated under the same key
and never makes a second task, conflicts are typed,
and the reading calls (find, list, events live and resumed) work."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import Proxy, Server, Tenant, key, payment

import idem


def test_a_dropped_first_answer_gets_the_same_task_on_retry(tenant: Tenant) -> None:
    k = key()
    with Proxy(tenant.url, ["drop"]) as proxy, idem.Client(proxy.url, tenant.client_key) as client:
        submitted = client.submit("payment.release", payment(), k)
    assert proxy.connections == 2, "the first connection lost its answer, the retry used a second"
    assert (submitted.tries, submitted.replayed, submitted.looked_up) == (2, True, False)
    with tenant.client() as client:
        assert client.find("payment.release", k).id == submitted.task.id
        tasks = list(client.list(operation="payment.release", idempotency_key_prefix=k))
        assert [t.id for t in tasks] == [submitted.task.id], "exactly one task for the scope"
        assert len(list(client.list())) == 1, "and none other in the tenant"


def test_the_async_client_retries_a_dropped_answer_the_same_way(tenant: Tenant) -> None:
    k = key()

    async def scenario() -> idem.Submitted:
        with Proxy(tenant.url, ["drop"]) as proxy:
            async with idem.AsyncClient(proxy.url, tenant.client_key) as client:
                return await client.submit("payment.release", payment(), k)

    submitted = asyncio.run(scenario())
    assert (submitted.tries, submitted.replayed) == (2, True)
    with tenant.client() as client:
        assert [t.id for t in client.list(idempotency_key_prefix=k)] == [submitted.task.id]


def test_when_every_try_is_lost_the_task_is_looked_up_by_its_scope(tenant: Tenant) -> None:
    k = key()
    retry = idem.RetryPolicy(max_tries=3, initial_backoff=0.01)
    with Proxy(tenant.url, ["drop"] * 3) as proxy, idem.Client(proxy.url, tenant.client_key, retry=retry) as client:
        submitted = client.submit("payment.release", payment(), k)
    assert (submitted.tries, submitted.looked_up, submitted.replayed) == (3, True, True)
    with tenant.client() as client:
        assert [t.id for t in client.list(idempotency_key_prefix=k)] == [submitted.task.id]


def test_a_lookup_never_returns_another_requests_task(tenant: Tenant) -> None:
    k = key()
    with tenant.client() as client:
        client.submit("payment.release", payment(100), k)
    retry = idem.RetryPolicy(max_tries=2, initial_backoff=0.01)
    with (
        Proxy(tenant.url, ["drop"] * 2) as proxy,
        idem.Client(proxy.url, tenant.client_key, retry=retry) as client,
        pytest.raises(idem.IdemTransportError),
    ):
        client.submit("payment.release", payment(200), k)


def test_503_is_repeated_after_its_retry_after(tenant: Tenant) -> None:
    k = key()
    with Proxy(tenant.url, ["503"]) as proxy, idem.Client(proxy.url, tenant.client_key) as client:
        started = time.monotonic()
        submitted = client.submit("payment.release", payment(), k)
        waited = time.monotonic() - started
    assert (submitted.tries, submitted.replayed) == (2, False)
    assert waited >= 1.0, f"Retry-After: 1 honoured, retried after {waited:.2f} s"


def test_a_conflict_raises_the_typed_error_with_differing_fields(tenant: Tenant) -> None:
    k = key()
    with tenant.client() as client:
        first = client.submit("payment.release", payment(1250), k)
        with pytest.raises(idem.IdempotencyConflictError) as raised:
            client.submit("payment.release", {**payment(1300), "note": "not material"}, k)
        assert raised.value.status == 422 and raised.value.code == "IDEMPOTENCY_CONFLICT"
        assert raised.value.task_id == first.task.id
        assert raised.value.differing_fields == ["/amount"]
        assert raised.value.request_id
        assert client.get(first.task.id).params == payment(1250), "the original is unchanged"


def test_errors_are_typed_by_code(tenant: Tenant) -> None:
    with tenant.client() as client:
        with pytest.raises(idem.NotFoundError):
            client.find("payment.release", key())
        with pytest.raises(idem.InvalidRequestError) as raised:
            client.submit("payment.release", {"payee": "x", "amount": 1}, key())
        assert raised.value.errors[0]["pointer"] == "/params/currency"
        with pytest.raises(ValueError):
            client.submit("payment.release", payment(), "a key with spaces")
    with idem.Client(tenant.url, "idem_not_a_key") as client, pytest.raises(idem.UnauthenticatedError):
        client.get("01a23c33-dcfe-744a-a0cc-f0089276e0e6")
    with idem.Client(tenant.url, tenant.executor_key) as client, pytest.raises(idem.PermissionDeniedError):
        client.submit("payment.release", payment(), key())


def test_keys_are_sent_as_sf_strings(tenant: Tenant) -> None:
    k = 'odd"key\\' + key()
    with tenant.client() as client:
        submitted = client.submit("generation.dispatch", {"n": 1}, k)
        assert submitted.task.idempotency_key == k
        assert client.find("generation.dispatch", k).id == submitted.task.id


def test_list_follows_cursor_pages(tenant: Tenant) -> None:
    with tenant.client() as client:
        ids = {client.submit("generation.dispatch", {"n": n}, key()).task.id for n in range(5)}
        assert {t.id for t in client.list(limit=2)} == ids
        queued = client.list(state=["queued"], operation="generation.dispatch", limit=2)
        assert [t.state for t in queued] == ["queued"] * 5
        assert list(client.list(state="running")) == []


def _run_to_delivery(tenant: Tenant, task_id: str) -> None:
    async def execute() -> None:
        async with tenant.executor() as ex:
            (a,) = await ex.claim("test", ["generation.dispatch"], lease_ms=5000)
            assert a.task_id == task_id
            await ex.heartbeat(a.id, a.generation, 2)
            await ex.report(a.id, {"generation": a.generation, "outcome": "succeeded", "result": {"ok": True}})

    asyncio.run(execute())


def test_live_events_end_after_the_terminal_event(tenant: Tenant) -> None:
    with tenant.client() as client:
        task = client.submit("generation.dispatch", {"n": 1}, key()).task
        _run_to_delivery(tenant, task.id)
        stored = [e.type for e in client.events(task.id)]
        assert stored[-1] == "delivered"
        assert [e.type for e in client.events(task.id, live=True)] == stored
        client.ack_delivery(task.id)
        assert client.get(task.id).delivery.acknowledged_at is not None


def test_live_events_resume_after_a_dropped_stream_without_gap_or_repeat(tenant: Tenant) -> None:
    with tenant.client() as client:
        task = client.submit("generation.dispatch", {"n": 1}, key()).task
        _run_to_delivery(tenant, task.id)
        stored = [(e.seq, e.type) for e in client.events(task.id)]
    with Proxy(tenant.url, ["cut"]) as proxy, idem.Client(proxy.url, tenant.client_key) as client:
        live = [(e.seq, e.type) for e in client.events(task.id, live=True)]
    assert proxy.connections == 2, "the stream was cut once and opened again"
    assert live == stored


def test_the_async_client_streams_while_the_task_runs(tenant: Tenant) -> None:
    async def scenario() -> tuple[list[str], idem.Task]:
        async with tenant.async_client() as client:
            task = (await client.submit("generation.dispatch", {"n": 1}, key())).task

            async def follow() -> list[str]:
                return [e.type async for e in client.events(task.id, live=True)]

            following = asyncio.create_task(follow())
            await asyncio.to_thread(_run_to_delivery, tenant, task.id)
            types = await asyncio.wait_for(following, 10)
            return types, await client.get(task.id, wait=5)

    types, task = asyncio.run(scenario())
    assert types[0] == "task_submitted" and types[-1] == "delivered"
    assert task.state == "succeeded" and task.usage == 2 and task.delivery.result == {"ok": True}
    # generation.dispatch names no fee currency: the charge is minor units of none.
    assert task.delivery.charge == task.contract["price"] and task.delivery.currency is None


def test_a_second_effect_is_shown_searched_and_acknowledged_by_an_admin(tenant: Tenant, server: Server) -> None:
    with tenant.client() as client, idem.Client(tenant.url, tenant.executor_key) as executor:
        task = client.submit("payment.release", payment(), key()).task
        (a,) = executor.claim("py-se", ["payment.release"], wait_ms=2000)
        executor.report(a.id, {"generation": a.generation, "outcome": "failed", "failure_class": "transient"})
        duplicate = {"generation": a.generation, "outcome": "succeeded", "result": {}, "external_txn_id": "psp-py"}
        with pytest.raises(idem.AttemptAlreadyReportedError):
            executor.report(a.id, duplicate)
        (effect,) = client.get(task.id).second_effects
        assert (effect.external_txn_id, effect.evidence, effect.acknowledgment) == ("psp-py", "duplicate_report", None)
        assert [t.id for t in client.list(second_effect="unacknowledged")] == [task.id]
        assert [t.id for t in client.list(external_txn_id="psp-py")] == [task.id]
        with pytest.raises(idem.PermissionDeniedError):
            client.acknowledge_second_effect(task.id, "psp-py", "refund_issued", "refunded")
        with idem.Client(tenant.url, server.create_key(tenant.name, "admin")) as admin:
            with pytest.raises(idem.NotFoundError):
                admin.acknowledge_second_effect(task.id, None, "false_alarm", "nothing")
            acked = admin.acknowledge_second_effect(task.id, "psp-py", "refund_issued", "refunded, ticket 3")
        ack = acked.second_effects[0].acknowledgment
        assert ack is not None and (ack.resolution, ack.reason) == ("refund_issued", "refunded, ticket 3")
        assert acked.state == "failed"
        assert list(client.list(second_effect="unacknowledged")) == []
