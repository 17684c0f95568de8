// The REST API from the page: the token (sessionStorage, sent only as the Bearer header),
// JSON requests, and Server-Sent Events read with fetch() (EventSource cannot send headers).

const TOKEN_KEY = "raytron-token";
export const API = "/api/v1";

export const token = {
  get: () => sessionStorage.getItem(TOKEN_KEY),
  set: (value) => sessionStorage.setItem(TOKEN_KEY, value),
  clear: () => sessionStorage.removeItem(TOKEN_KEY),
};

/** An answer that was not 2xx: `status` and the API's `{code, message, errors}` body. */
export class ApiError extends Error {
  constructor(status, body) {
    super(body.message || `HTTP ${status}`);
    this.status = status;
    this.body = body;
  }
}

/** Called on any 401 (set by the page: it asks for the token again). */
export let onUnauthorized = () => {};
export function setOnUnauthorized(fn) { onUnauthorized = fn; }

function headers(extra = {}) {
  return { Authorization: `Bearer ${token.get() || ""}`, ...extra };
}

/** fetch() with the token; throws ApiError on a non-2xx answer. */
export async function request(path, { method = "GET", body, raw, accept, signal } = {}) {
  const init = { method, headers: headers(accept ? { Accept: accept } : {}), signal };
  if (body !== undefined) {
    init.body = raw ? body : JSON.stringify(body);
    init.headers["Content-Type"] = raw ? "text/plain" : "application/json";
  }
  const res = await fetch(path, init);
  if (!res.ok) {
    let detail;
    try { detail = await res.json(); } catch { detail = { message: `HTTP ${res.status}` }; }
    if (res.status === 401) onUnauthorized();
    throw new ApiError(res.status, detail);
  }
  return res;
}

export const getJSON = async (path, opts) => (await request(path, opts)).json();
export const postJSON = async (path, body) => (await request(path, { method: "POST", body })).json();

/**
 * Follow a job's event stream until its `end` event: `onEvent(kind, data)` per event after seq
 * `after` (0: all of them; a job's `last_seq`: only what is new). Reconnects after a dropped
 * connection with Last-Event-ID, so no event is seen twice.
 */
export async function followEvents(jobId, onEvent, signal, after = 0) {
  let last = after;
  while (!signal.aborted) {
    let ended = false;
    try {
      const extra = { Accept: "text/event-stream", ...(last ? { "Last-Event-ID": String(last) } : {}) };
      const res = await fetch(`${API}/jobs/${jobId}/events`, { headers: headers(extra), signal });
      if (res.status === 401) { onUnauthorized(); return; }
      if (!res.ok) throw new Error(`HTTP ${res.status}`);
      const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value.replace(/\r\n/g, "\n");
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const fields = {};
          for (const line of block.split("\n")) {
            if (!line || line.startsWith(":")) continue;  // a keepalive comment
            const i = line.indexOf(":");
            const key = i < 0 ? line : line.slice(0, i);
            fields[key] = (fields[key] ? fields[key] + "\n" : "") + (i < 0 ? "" : line.slice(i + 1).replace(/^ /, ""));
          }
          if (!fields.event && !fields.data) continue;
          if (fields.id) last = Number(fields.id);
          onEvent(fields.event || "message", fields.data ? JSON.parse(fields.data) : null);
          if (fields.event === "end") ended = true;
        }
      }
    } catch (err) {
      if (signal.aborted) return;
    }
    if (ended) return;
    await new Promise((r) => setTimeout(r, 1000));
  }
}

/** Follow a job's log (`?follow=true`), calling `onText(chunk)`; reconnects at the byte it had reached. */
export async function followLog(jobId, onText, signal) {
  let offset = 0;
  const decoder = new TextDecoder();
  while (!signal.aborted) {
    try {
      const res = await fetch(`${API}/jobs/${jobId}/logs?follow=true&offset=${offset}`, { headers: headers(), signal });
      if (!res.ok) return;
      const reader = res.body.getReader();
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;  // the server ends the stream when the job has ended
        offset += value.length;
        onText(decoder.decode(value, { stream: true }));
      }
    } catch (err) {
      if (signal.aborted) return;
    }
    await new Promise((r) => setTimeout(r, 1000));
  }
}
