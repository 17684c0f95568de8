"""``/api/v1/jobs/{id}/events`` and ``/logs``: JSON, or streams that follow the job to its end.

Events stream as Server-Sent Events when the client sends ``Accept: text/event-stream``: each
event is ``id: SEQ`` (the store's seq), ``event: KIND``, ``data: JSON``; a reconnecting client
sends ``Last-Event-ID`` and gets only what came after. The stream ends with ``event: end`` once
the job is in a final state and every event before it has been sent.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.rest.deps import SettingsDep, StoreDep
from api.rest.errors import ApiError
from api.rest.routes.jobs import _ERRORS, get_row
from api.rest.schemas import EventList
from service.server.logs import log_path, read_log
from service.server.store import TERMINAL_STATES, JobStore

router = APIRouter(prefix="/jobs", tags=["jobs"])
POLL_S = 0.2
KEEPALIVE_S = 15.0
MAX_SEQ = 2**31 - 1
MAX_LOG_OFFSET = 2**53 - 1  # the largest integer every JSON client holds exactly


def _sse(event: dict) -> str:
    return f"id: {event['seq']}\nevent: {event['kind']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


def _deadline(settings) -> float:
    return time.monotonic() + settings.max_stream_s if settings.max_stream_s else float("inf")


async def _event_stream(request: Request, store: JobStore, job_id: str, after: int, deadline: float):
    last, quiet_since = after, time.monotonic()
    while time.monotonic() < deadline:  # past it the stream ends without "end": the client resumes
        # The state is read before the events: a final state seen here has its event in the read below.
        row = await run_in_threadpool(store.get_job, job_id)
        events = await run_in_threadpool(store.events, job_id, last, limit=500)
        for event in events:
            yield _sse(event)
            last = event["seq"]
        if len(events) == 500:
            continue
        if row["state"] in TERMINAL_STATES:
            yield f"event: end\ndata: {json.dumps({'job_id': job_id, 'state': row['state'], 'last_seq': last})}\n\n"
            return
        if events:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > KEEPALIVE_S:
            yield ": keepalive\n\n"  # proxies close idle connections
            quiet_since = time.monotonic()
        if await request.is_disconnected():
            return
        await asyncio.sleep(POLL_S)


@router.get("/{job_id}/events", response_model=EventList, responses={**_ERRORS, 200: {
    "content": {"application/json": {}, "text/event-stream": {"description": "SSE, live until the job ends"}}}})
async def get_events(job_id: str, request: Request, store: StoreDep, settings: SettingsDep,
                     after: int = Query(0, ge=0, le=MAX_SEQ, description="only events with a larger seq"),
                     kind: str | None = Query(None, max_length=32, description="only events of this kind"),
                     exclude_kind: str | None = Query(None, max_length=32, description="leave out events of this "
                                                      "kind (e.g. iteration: the history without the curve)"),
                     last_event_id: int | None = Header(None, ge=0, le=MAX_SEQ, description="SSE resume: the last "
                                                        "seq received (only later events are sent)")):
    """The job's history: state changes, placement, iterations, failures. SSE with ``Accept: text/event-stream``
    (live until the job ends; ``kind`` and ``exclude_kind`` apply to the JSON answer only)."""
    await run_in_threadpool(get_row, store, job_id)
    if last_event_id is not None:
        after = max(after, last_event_id)
    if "text/event-stream" in request.headers.get("accept", ""):
        return StreamingResponse(_event_stream(request, store, job_id, after, _deadline(settings)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    events = await run_in_threadpool(store.events, job_id, after, kind=kind, exclude_kind=exclude_kind)
    return {"job_id": job_id, "events": events}


async def _log_stream(request: Request, store: JobStore, path, offset: int, job_id: str, deadline: float):
    # read_log answers any offset (past the end: nothing), so the stream never breaks mid-way
    ended_at = None
    while time.monotonic() < deadline:
        data, offset = await run_in_threadpool(read_log, path, offset)
        if data:
            yield data
            continue
        row = await run_in_threadpool(store.get_job, job_id)
        if row["state"] in TERMINAL_STATES:
            # The runner writes its last lines right after recording the final state: give it a moment.
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at > 1.0:
                return
        if await request.is_disconnected():
            return
        await asyncio.sleep(POLL_S)


@router.get("/{job_id}/logs", response_class=PlainTextResponse, responses={**_ERRORS, 200: {
    "description": "the log from `offset` (empty past its end); with follow=true, streamed until the job ends",
    "headers": {"X-Log-Offset": {"description": "the byte after the text sent (not with follow=true)",
                                 "schema": {"type": "integer"}}}}})
async def get_logs(job_id: str, request: Request, store: StoreDep, settings: SettingsDep,
                   follow: bool = Query(False, description="stream until the job ends"),
                   offset: int = Query(0, ge=0, le=MAX_LOG_OFFSET, description="start at this byte of the log")):
    """The job's log (its runner and rank processes), plain text."""
    await run_in_threadpool(get_row, store, job_id)
    path = log_path(settings.data_dir, job_id)
    if follow:
        return StreamingResponse(_log_stream(request, store, path, offset, job_id, _deadline(settings)),
                                 media_type="text/plain")
    data, end = await run_in_threadpool(read_log, path, offset, 16 << 20)
    return PlainTextResponse(data.decode(errors="replace"), headers={"X-Log-Offset": str(end)})
