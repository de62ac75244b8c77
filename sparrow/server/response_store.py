"""Stored responses (`store: true`) in SQLite: each response's JSON, the input items its
request gave, its whole conversation (every earlier turn's items, then its input and
output items) and its token ids (the prompt as run, then the output): what
`previous_response_id` continues. One thread owns the connection and
runs every statement, so the event loop never waits on the disk.

The database is a file (`--responses-db PATH`, WAL journal: responses outlive the
process) or, by default, in memory (lost when the server stops, as vLLM's store). Stored
bytes are held under a cap, the oldest responses evicted first, and each response expires
`ttl_s` seconds after it is stored. Only the HTTP app touches the store: behind `sparrow
gateway` the gateway holds it and workers keep no state."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

logger = logging.getLogger(__name__)

MAX_MB = 256.0  # stored JSON, MiB
TTL_S = 30 * 86400.0  # OpenAI keeps responses 30 days
SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- storing order: eviction takes the lowest
    id TEXT UNIQUE NOT NULL,
    expires_at REAL,                        -- unix time; NULL: never
    bytes INTEGER NOT NULL,                 -- of the four JSON texts
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    conversation TEXT NOT NULL,
    tokens TEXT NOT NULL                    -- the prompt's ids and the output's, as run
);
CREATE INDEX IF NOT EXISTS responses_expiry ON responses (expires_at);
"""


@dataclass(frozen=True)
class ResponseStoreSettings:
    path: str | None = None  # None: in memory
    max_mb: float = MAX_MB
    ttl_s: float | None = TTL_S  # None: responses do not expire


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    conversation: list[dict[str, Any]]
    tokens: list[int]  # the prompt's ids, then the output's: what a continuation extends


class ResponseStore:
    """Responses by id. The async methods run on the store's thread; `clock` gives unix
    time (tests move it)."""

    def __init__(
        self, settings: ResponseStoreSettings, clock: Callable[[], float] = time.time
    ) -> None:
        self.settings, self.clock = settings, clock
        self.max_bytes = int(settings.max_mb * (1 << 20))
        self.evicted = {"size": 0, "expired": 0}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="sparrow-responses-db")
        # made here so that a bad path fails at startup; used on the store's thread only
        self._db = sqlite3.connect(settings.path or ":memory:", check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")  # a file's; memory keeps its own
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._db.commit()
        row = self._db.execute("SELECT count(*), coalesce(sum(bytes), 0) FROM responses")
        self.count, self.bytes = row.fetchone()

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def put(
        self,
        response: dict,
        input_items: list[dict],
        conversation: list[dict],
        tokens: list[int],
    ) -> bool:
        """Stores `response` (by its id) with its conversation and token ids; False when it
        alone is over the size cap (not stored)."""
        values = (response, input_items, conversation, tokens)
        texts = [json.dumps(v, ensure_ascii=False) for v in values]
        return await self._run(self._put, response["id"], texts)

    async def get(self, response_id: str) -> StoredResponse | None:
        """The response, None when it is not stored (unknown, deleted, evicted, expired)."""
        row = await self._run(self._get, response_id)
        return None if row is None else StoredResponse(*(json.loads(t) for t in row))

    async def delete(self, response_id: str) -> bool:
        """True when the response was stored."""
        return await self._run(self._delete, response_id)

    def close(self) -> None:
        self._thread.submit(self._db.close)
        self._thread.shutdown(wait=True)

    def _put(self, response_id: str, texts: list[str]) -> bool:
        size = sum(len(t.encode()) for t in texts)
        if size > self.max_bytes:
            logger.warning(
                "response %s is %d bytes, over the store's %d: not stored",
                response_id,
                size,
                self.max_bytes,
            )
            return False
        now = self.clock()
        self._expire(now)
        self._evict(size)
        ttl = self.settings.ttl_s
        old = self._db.execute("DELETE FROM responses WHERE id = ? RETURNING bytes", [response_id])
        for (gone,) in old.fetchall():
            self.count, self.bytes = self.count - 1, self.bytes - gone
        self._db.execute(
            "INSERT INTO responses"
            " (id, expires_at, bytes, response, input_items, conversation, tokens)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            [response_id, None if ttl is None else now + ttl, size, *texts],
        )
        self._db.commit()
        self.count, self.bytes = self.count + 1, self.bytes + size
        return True

    def _expire(self, now: float) -> None:
        rows = self._db.execute(
            "DELETE FROM responses WHERE expires_at <= ? RETURNING bytes", [now]
        ).fetchall()
        self._forget(rows, "expired")

    def _evict(self, size: int) -> None:
        """The oldest responses removed until `size` more bytes fit under the cap."""
        while self.count and self.bytes + size > self.max_bytes:
            rows = self._db.execute(
                "SELECT seq, bytes FROM responses ORDER BY seq LIMIT 64"
            ).fetchall()
            last, freed = rows[-1][0], 0
            for seq, n in rows:
                freed += n
                if self.bytes - freed + size <= self.max_bytes:
                    last = seq
                    break
            gone = self._db.execute(
                "DELETE FROM responses WHERE seq <= ? RETURNING bytes", [last]
            ).fetchall()
            self._forget(gone, "size")

    def _forget(self, rows: list[tuple[int]], reason: str) -> None:
        self.count -= len(rows)
        self.bytes -= sum(n for (n,) in rows)
        self.evicted[reason] += len(rows)

    def _get(self, response_id: str) -> tuple[str, str, str, str] | None:
        return self._db.execute(
            "SELECT response, input_items, conversation, tokens FROM responses"
            " WHERE id = ? AND (expires_at IS NULL OR expires_at > ?)",
            [response_id, self.clock()],
        ).fetchone()

    def _delete(self, response_id: str) -> bool:
        rows = self._db.execute(
            "DELETE FROM responses WHERE id = ? AND (expires_at IS NULL OR expires_at > ?)"
            " RETURNING bytes",
            [response_id, self.clock()],
        ).fetchall()
        self._db.commit()
        self.count -= len(rows)
        self.bytes -= sum(n for (n,) in rows)
        return bool(rows)


class StoreCollector:
    """The store's size and evictions for /metrics."""

    def __init__(self, store: ResponseStore):
        self.store = store

    def collect(self):
        stored = GaugeMetricFamily(
            "sparrow_responses_stored", "responses in the store", value=self.store.count
        )
        size = GaugeMetricFamily(
            "sparrow_responses_stored_bytes", "JSON bytes in the store", value=self.store.bytes
        )
        evicted = CounterMetricFamily(
            "sparrow_responses_evicted",
            "stored responses removed: over the size cap or expired",
            labels=["reason"],
        )
        for reason, n in self.store.evicted.items():
            evicted.add_metric([reason], n)
        return [stored, size, evicted]
