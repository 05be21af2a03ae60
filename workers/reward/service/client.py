"""Clients of the reward service (httpx): :class:`RewardClient` (sync) and
:class:`AsyncRewardClient` (asyncio), the same methods.

A trainer registers its task once, announces each rollout batch with its size as soon as the
rollout starts (the hint that lets the service scale before the first response is done), then
submits one request per finished response and collects the batch's rewards::

    with RewardClient("http://127.0.0.1:8765", token) as rc:
        rc.register("task-a", "code")
        batch = rc.announce("task-a", size=len(responses))
        for i, r in enumerate(responses):          # as each response finishes
            rc.submit("task-a", batch, {"code": r, "tests": tests[i]}, id=str(i))
        rewards = rc.rewards("task-a", batch, timeout_s=600)   # id -> reward

Every wait has a timeout; :class:`RewardServiceError` carries the server's message.
"""

from __future__ import annotations

import asyncio
import time

import httpx


class RewardServiceError(RuntimeError):
    """The service refused a call (``status``: HTTP status) or a wait timed out."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


def _check(resp: httpx.Response) -> dict:
    if resp.status_code >= 400:
        try:
            detail = resp.json().get("detail")
        except ValueError:
            detail = resp.text
        raise RewardServiceError(resp.status_code, str(detail))
    return resp.json()


def _base(task: str, batch: str | None = None) -> str:
    return f"/v1/tasks/{task}" + (f"/batches/{batch}" if batch else "")


class RewardClient:
    """Synchronous client. ``timeout_s``: per HTTP call (seconds)."""

    def __init__(self, url: str, token: str, timeout_s: float = 30.0) -> None:
        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s
        )

    def __enter__(self) -> RewardClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def register(self, task: str, pipeline: str, delay_bound_s: float | None = None) -> dict:
        body = {"task": task, "pipeline": pipeline, "delay_bound_s": delay_bound_s}
        return _check(self.http.post("/v1/tasks", json=body))

    def announce(self, task: str, size: int, batch: str | None = None) -> str:
        """Announce a batch of ``size`` requests; returns its id."""
        body = {"size": size, "batch": batch}
        return _check(self.http.post(f"{_base(task)}/batches", json=body))["batch"]

    def submit(self, task: str, batch: str, payload: dict, id: str | None = None) -> str:
        body = {"payload": payload, "id": id}
        return _check(self.http.post(f"{_base(task, batch)}/requests", json=body))["id"]

    def close_batch(self, task: str, batch: str) -> dict:
        """No more requests for ``batch`` (its size becomes what was submitted)."""
        return _check(self.http.post(f"{_base(task, batch)}/close"))

    def status(self, task: str, batch: str) -> dict:
        return _check(self.http.get(_base(task, batch)))

    def metrics(self) -> dict:
        return _check(self.http.get("/v1/metrics"))

    def results(self, task: str, batch: str, timeout_s: float = 600.0) -> list[dict]:
        """All results of ``batch`` once it is complete (long-polls).

        Raises:
            RewardServiceError: (408) not complete within ``timeout_s``.
        """
        out: list[dict] = []
        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise RewardServiceError(408, f"batch {batch!r} not complete in {timeout_s} s")
            page = _check(
                self.http.get(
                    f"{_base(task, batch)}/results",
                    params={"offset": len(out), "wait_s": min(left, 20.0)},
                    timeout=min(left, 20.0) + 30.0,
                )
            )
            out += page["results"]
            if page["complete"]:
                return out

    def rewards(self, task: str, batch: str, timeout_s: float = 600.0) -> dict[str, float]:
        """``request id -> reward`` of the whole batch (waits up to ``timeout_s``)."""
        return {r["id"]: r["reward"] for r in self.results(task, batch, timeout_s)}


class AsyncRewardClient:
    """Asyncio client; same methods as :class:`RewardClient`, awaitable."""

    def __init__(self, url: str, token: str, timeout_s: float = 30.0) -> None:
        self.http = httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s
        )

    async def __aenter__(self) -> AsyncRewardClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.http.aclose()

    async def register(self, task: str, pipeline: str, delay_bound_s: float | None = None):
        body = {"task": task, "pipeline": pipeline, "delay_bound_s": delay_bound_s}
        return _check(await self.http.post("/v1/tasks", json=body))

    async def announce(self, task: str, size: int, batch: str | None = None) -> str:
        body = {"size": size, "batch": batch}
        return _check(await self.http.post(f"{_base(task)}/batches", json=body))["batch"]

    async def submit(self, task: str, batch: str, payload: dict, id: str | None = None) -> str:
        body = {"payload": payload, "id": id}
        return _check(await self.http.post(f"{_base(task, batch)}/requests", json=body))["id"]

    async def close_batch(self, task: str, batch: str) -> dict:
        return _check(await self.http.post(f"{_base(task, batch)}/close"))

    async def status(self, task: str, batch: str) -> dict:
        return _check(await self.http.get(_base(task, batch)))

    async def metrics(self) -> dict:
        return _check(await self.http.get("/v1/metrics"))

    async def results(self, task: str, batch: str, timeout_s: float = 600.0) -> list[dict]:
        out: list[dict] = []
        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise RewardServiceError(408, f"batch {batch!r} not complete in {timeout_s} s")
            page = _check(
                await self.http.get(
                    f"{_base(task, batch)}/results",
                    params={"offset": len(out), "wait_s": min(left, 20.0)},
                    timeout=min(left, 20.0) + 30.0,
                )
            )
            out += page["results"]
            if page["complete"]:
                return out
            await asyncio.sleep(0)

    async def rewards(self, task: str, batch: str, timeout_s: float = 600.0) -> dict[str, float]:
        return {r["id"]: r["reward"] for r in await self.results(task, batch, timeout_s)}
