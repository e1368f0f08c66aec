// A client of the sidecar's websocket protocol (docs/protocol.md) for browsers, Node.js,
// Deno and Bun: plain JavaScript that runs without a build step, typed by index.d.ts and
// protocol.d.ts (generated from sidecar/protocol.py). Its only dependency is the platform's
// WebSocket (Node.js 22+: global; Node.js 20: `node --experimental-websocket`; else pass one
// as `options.WebSocket`).

import { VERSION, CLIENT_TYPES, SERVER_TYPES } from "./protocol.js";

export { VERSION, CLIENT_TYPES, SERVER_TYPES };

const RETRY_MS = 200; // between attempts to connect while the sidecar is down or loading (503)
const CLOSE_WAIT_MS = 2000; // close() waits this long for the closing handshake

/** The sidecar refused something, or the connection was lost before an answer came.
 * `code` is the protocol's error code (docs/protocol.md, "Errors"), or one of the client's
 * own: `connect_failed`, `disconnected`, `closed`, `bad_frame`. */
export class SidecarError extends Error {
  /** @param {string} message @param {string} code @param {import("./protocol.js").Ref | null} [ref] */
  constructor(message, code, ref = null) {
    super(message);
    this.name = "SidecarError";
    this.code = code;
    this.ref = ref;
  }
}

/** Messages in arrival order for one iterator: filled by the client, drained by `next()`. */
class Inbox {
  /** @param {(msg: any) => boolean} accepts @param {() => void} detach */
  constructor(accepts, detach) {
    this.accepts = accepts;
    this.detach = detach;
    /** @type {any[]} */ this.items = [];
    /** @type {{resolve: Function, reject: Function}[]} */ this.waiters = [];
    this.done = false;
    /** @type {Error | null} */ this.error = null;
  }

  push(msg) {
    if (this.done || !this.accepts(msg)) return;
    const waiter = this.waiters.shift();
    if (waiter) waiter.resolve({ value: msg, done: false });
    else this.items.push(msg);
  }

  /** No more messages: waiting and later `next()` calls end, or throw `error`. */
  finish(error = null) {
    if (this.done) return;
    this.done = true;
    this.error = error;
    for (const w of this.waiters.splice(0)) error ? w.reject(error) : w.resolve({ value: undefined, done: true });
  }

  /** @returns {Promise<IteratorResult<any>>} */
  next() {
    if (this.items.length) return Promise.resolve({ value: this.items.shift(), done: false });
    if (this.done) return this.error ? Promise.reject(this.error) : Promise.resolve({ value: undefined, done: true });
    return new Promise((resolve, reject) => this.waiters.push({ resolve, reject }));
  }

  /** @returns {Promise<IteratorResult<any>>} */
  return() {
    this.detach();
    this.items = [];
    this.finish();
    return Promise.resolve({ value: undefined, done: true });
  }

  [Symbol.asyncIterator]() {
    return this;
  }
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const refKey = (ref) => JSON.stringify(ref); // "1" and 1 are different refs

/** One session with a sidecar, over one websocket at a time: `reconnect()` (or a lost
 * connection, unless `reconnect: false`) opens a new one that says `hello.resume`, so the
 * records it resends count once. */
export class SidecarClient {
  /** Connects, says hello and waits for `ready`; retries while the sidecar is unreachable or
   * still loading, for `waitMs`. @param {string} url @param {import("./index.js").ConnectOptions} options */
  static async connect(url, options) {
    if (!options || typeof options.session !== "string" || !options.session) {
      throw new TypeError("SidecarClient.connect(url, {session}): session is required");
    }
    const client = new SidecarClient(url, options);
    await client.#connect(options.resume ?? null, options.waitMs ?? 30000);
    return client;
  }

  #url;
  #options;
  #WebSocket;
  /** @type {WebSocket | null} */ #ws = null;
  /** @type {Promise<void> | null} */ #reconnecting = null;
  #closing = false;
  #closed = false;
  #refPrefix;
  #refCount = 0;
  /** Frames sent while no connection is open, in order, for the next one. @type {any[]} */ #queued = [];
  /** Streams this connection has sent on. */ #streams = new Set();
  /** end() calls waiting for `ended`, by stream, in order; `sent`: its frame went out on this connection.
   * @type {Map<string, {resolve: Function, reject: Function, sent: boolean}[]>} */
  #ends = new Map();
  /** tool_result and feedback frames waiting for their ack, by ref. @type {Map<string, {frame: any, resolve: Function, reject: Function}>} */
  #records = new Map();
  /** @type {{resolve: Function, reject: Function}[]} */ #pings = [];
  /** @type {Set<Inbox>} */ #inboxes = new Set();

  /** The current connection's `ready` (set before connect() resolves). */
  ready = /** @type {import("./protocol.js").Ready} */ (/** @type {unknown} */ (null));
  /** How many connections this client has opened (1 until a reconnect). */
  connections = 0;

  /** Use `SidecarClient.connect`. */
  constructor(url, options) {
    this.#url = options.token ? withToken(url, options.token) : url;
    this.#options = options;
    this.#WebSocket = options.WebSocket ?? globalThis.WebSocket;
    if (typeof this.#WebSocket !== "function") {
      throw new SidecarError("no WebSocket: Node.js 20 needs --experimental-websocket (22+ has one); or pass options.WebSocket", "connect_failed");
    }
    const random = globalThis.crypto?.randomUUID?.() ?? `${Date.now().toString(36)}${Math.random().toString(36).slice(2)}`;
    this.#refPrefix = `ts-${random}-`;
  }

  /** Whether `close()` was called or the connection was lost for good. */
  get closed() {
    return this.#closed;
  }

  /** Whether a connection is open and ready now (false while reconnecting: frames then wait). */
  get connected() {
    return this.#connected();
  }

  /** A user turn, judged whole. @param {string} stream @param {string} text */
  user(stream, text) {
    this.#send({ type: "user", stream, text });
  }

  /** An increment of the LLM's reply on `stream`, any size. @param {string} stream @param {string} delta */
  token(stream, delta) {
    this.#send({ type: "token", stream, delta });
  }

  /** Ends `stream`; resolves with its `ended` once everything sent on it is judged and its
   * injects delivered. Rejects (`disconnected`) if the connection is lost first.
   * @param {string} stream @returns {Promise<import("./protocol.js").Ended>} */
  end(stream) {
    return new Promise((resolve, reject) => {
      this.#check();
      const waiting = this.#ends.get(stream) ?? [];
      waiting.push({ resolve, reject, sent: false });
      this.#ends.set(stream, waiting);
      this.#send({ type: "end", stream });
    });
  }

  /** One call of a tool, for the recommender's history; resolves with its `ack` once stored.
   * Without a `ref` the client makes one, so the frame can be resent after a reconnect.
   * @param {Omit<import("./protocol.js").ToolResult, "type">} result @returns {Promise<import("./protocol.js").Ack>} */
  toolResult(result) {
    return this.#record({ type: "tool_result", ...result });
  }

  /** A rating of a tool; resolves with its `ack` once stored (a `ref` as for toolResult).
   * @param {Omit<import("./protocol.js").Feedback, "type">} feedback @returns {Promise<import("./protocol.js").Ack>} */
  feedback(feedback) {
    return this.#record({ type: "feedback", ...feedback });
  }

  /** Resolves at the sidecar's `pong`; rejects (`disconnected`) while no connection is open.
   * @returns {Promise<void>} */
  ping() {
    return new Promise((resolve, reject) => {
      this.#check();
      if (!this.#connected()) throw new SidecarError("no connection is open (reconnecting)", "disconnected");
      this.#pings.push({ resolve, reject });
      this.#write({ type: "ping" });
    });
  }

  /** The `inject`s that arrive from now on, on every stream (or on `stream` only), across
   * reconnects; ends at close(), throws if the connection is lost for good. Make it before
   * sending what it should see: nothing is kept for an iterator not yet made.
   * @param {string} [stream] @returns {AsyncIterableIterator<import("./protocol.js").Inject>} */
  injects(stream) {
    return this.#inbox((m) => m.type === "inject" && (stream === undefined || m.stream === stream));
  }

  /** Every sidecar message that arrives from now on (ready aside), as `injects()` does.
   * @returns {AsyncIterableIterator<import("./protocol.js").ServerMessage>} */
  messages() {
    return this.#inbox(() => true);
  }

  [Symbol.asyncIterator]() {
    return this.messages();
  }

  /** Opens a new connection that resumes this one (`hello.resume`): unacknowledged
   * tool_result and feedback frames are resent and count once. Streams do not carry over: an
   * `end()` still waiting rejects with `disconnected`. @returns {Promise<import("./protocol.js").Ready>} */
  async reconnect() {
    this.#check();
    if (!this.#reconnecting) this.#reconnecting = this.#resume(this.#ws);
    await this.#reconnecting;
    if (this.#closed) throw new SidecarError("could not reconnect to the sidecar", "disconnected");
    return this.ready;
  }

  /** Closes the connection; iterators end, and answers still awaited reject with `closed`. */
  async close() {
    if (this.#closed) return;
    this.#closing = true;
    const ws = this.#ws;
    if (ws && ws.readyState <= 1) {
      const gone = new Promise((resolve) => ws.addEventListener("close", resolve, { once: true }));
      ws.close(1000);
      await Promise.race([gone, sleep(CLOSE_WAIT_MS)]);
    }
    this.#finish(null, new SidecarError("the client was closed before the answer came", "closed"));
  }

  // Internals -------------------------------------------------------------------------

  #check() {
    if (this.#closed || this.#closing) throw new SidecarError("the client is closed", "closed");
  }

  #inbox(accepts) {
    const inbox = new Inbox(accepts, () => this.#inboxes.delete(inbox));
    if (this.#closed) inbox.finish();
    else this.#inboxes.add(inbox);
    return inbox;
  }

  #record(frame) {
    return new Promise((resolve, reject) => {
      this.#check();
      if (frame.ref === undefined || frame.ref === null) frame.ref = this.#refPrefix + ++this.#refCount;
      const key = refKey(frame.ref);
      if (this.#records.has(key)) {
        reject(new SidecarError(`ref ${key} is still waiting for its ack`, "bad_frame", frame.ref));
        return;
      }
      this.#records.set(key, { frame, resolve, reject });
      this.#send(frame);
    });
  }

  #send(frame) {
    this.#check();
    if (this.#connected()) this.#write(frame);
    else this.#queued.push(frame); // sent once a connection is ready again
  }

  #connected() {
    return this.#ws !== null && this.#ws.readyState === 1 && !this.#reconnecting;
  }

  #write(frame) {
    if (frame.type === "user" || frame.type === "token") this.#streams.add(frame.stream);
    if (frame.type === "end") {
      const waiter = this.#ends.get(frame.stream)?.find((w) => !w.sent);
      if (!this.#streams.has(frame.stream)) { // never sent on this connection: the sidecar would answer unknown_stream
        const lost = new SidecarError(`stream ${JSON.stringify(frame.stream)} was never sent on this connection (lost with an earlier one?)`, "disconnected");
        if (waiter) this.#settle(frame.stream, (w) => w === waiter, lost);
        return;
      }
      if (waiter) waiter.sent = true;
    }
    /** @type {WebSocket} */ (this.#ws).send(JSON.stringify(frame));
  }

  /** One attempt: a socket, hello, and its ready. Rejects with a SidecarError whose code is the
   * sidecar's when it refused the hello, `connect_failed` when no connection was made. */
  #handshake(resume) {
    return new Promise((resolve, reject) => {
      let ws;
      try {
        ws = new this.#WebSocket(this.#url);
      } catch (e) {
        reject(new SidecarError(`bad sidecar URL ${this.#url}: ${e.message}`, "bad_url"));
        return;
      }
      let settled = false;
      const fail = (error) => {
        if (settled) return;
        settled = true;
        try { ws.close(); } catch { /* already closing */ }
        reject(error);
      };
      ws.onerror = (e) => fail(new SidecarError(`could not connect to ${this.#url}: ${e?.message ?? e?.error?.message ?? "network error"}`, "connect_failed"));
      ws.onclose = (e) => fail(new SidecarError(`the sidecar closed the connection before ready (code ${e.code})`, "connect_failed"));
      ws.onopen = () => {
        const o = this.#options;
        const hello = { type: "hello", session: o.session, version: VERSION, agent: o.agent, project: o.project,
                        permissions: o.permissions, tools: o.tools, decisions: o.decisions || undefined, resume: resume ?? undefined };
        ws.send(JSON.stringify(hello));
      };
      ws.onmessage = (e) => {
        let msg;
        try {
          msg = JSON.parse(e.data);
        } catch {
          fail(new SidecarError("the sidecar's first frame is not JSON", "bad_frame"));
          return;
        }
        if (msg?.type === "error") fail(new SidecarError(`hello refused: ${msg.code}: ${msg.message}`, msg.code));
        else if (msg?.type !== "ready") fail(new SidecarError(`expected ready, got ${msg?.type}`, "bad_frame"));
        else {
          settled = true;
          resolve({ ws, ready: msg });
        }
      };
    });
  }

  /** Connects (retrying a failed connection until `waitMs` has passed) and takes the connection. */
  async #connect(resume, waitMs) {
    const deadline = Date.now() + waitMs;
    for (;;) {
      let opened;
      try {
        opened = await this.#handshake(resume);
      } catch (e) {
        if (e.code !== "connect_failed" || Date.now() + RETRY_MS > deadline || this.#closing) throw e;
        await sleep(RETRY_MS);
        continue;
      }
      if (this.#closing) {
        opened.ws.close(1000);
        throw new SidecarError("the client was closed while connecting", "closed");
      }
      this.#adopt(opened.ws, opened.ready);
      return;
    }
  }

  #adopt(ws, ready) {
    this.#ws = ws;
    this.ready = ready;
    this.connections += 1;
    this.#streams = new Set();
    ws.onerror = null;
    // A replaced connection's late answers are dropped: its unacknowledged records are resent
    // on the new one (and count once), its streams were settled as lost.
    ws.onmessage = (e) => ws === this.#ws && this.#receive(e.data);
    ws.onclose = () => {
      if (ws !== this.#ws || this.#closing) return; // replaced, or closed on purpose
      if (this.#options.reconnect === false) this.#finish(new SidecarError("the connection to the sidecar was lost", "disconnected"));
      else if (!this.#reconnecting) this.#reconnecting = this.#resume(ws).catch(() => {}); // #resume finishes on failure
    };
  }

  /** Replaces connection `old` by a new one that resumes it, then sends what waited. */
  async #resume(old) {
    const key = this.ready.resume || null;
    this.#ws = null; // its close is no loss to react to
    if (old && old.readyState <= 1) old.close(1000);
    const lost = new SidecarError("the connection was lost before the answer came", "disconnected");
    for (const stream of [...this.#ends.keys()]) this.#settle(stream, (w) => w.sent, lost); // nothing will answer them
    for (const p of this.#pings.splice(0)) p.reject(lost);
    try {
      await this.#connect(key, this.#options.reconnectWaitMs ?? 30000);
    } catch (e) {
      const gone = e.code === "closed" ? e : new SidecarError(`the connection was lost and could not be resumed: ${e.message}`, "disconnected");
      this.#finish(gone);
      this.#reconnecting = null;
      throw gone;
    }
    this.#reconnecting = null;
    const queued = this.#queued.splice(0);
    const waited = new Set(queued);
    // Sent before the loss and not acknowledged: resent first (they came before anything queued;
    // a tool_result labels the last user turn), counted once under the resumed key.
    for (const r of this.#records.values()) if (!waited.has(r.frame)) this.#write(r.frame);
    for (const frame of queued) this.#write(frame);
  }

  /** Settles the end() calls on `stream` that `which` picks, with `ended` or an error. */
  #settle(stream, which, result) {
    const waiting = this.#ends.get(stream) ?? [];
    const [picked, kept] = [waiting.filter(which), waiting.filter((w) => !which(w))];
    for (const w of picked) result instanceof Error ? w.reject(result) : w.resolve(result);
    if (kept.length) this.#ends.set(stream, kept);
    else this.#ends.delete(stream);
  }

  #receive(data) {
    let msg;
    try {
      msg = JSON.parse(data);
    } catch {
      return; // not the sidecar's: ignored, as unknown fields are
    }
    if (msg === null || typeof msg !== "object") return;
    switch (msg.type) {
      case "ended": { // one answers each end, in order
        const first = this.#ends.get(msg.stream)?.find((w) => w.sent);
        if (first) this.#settle(msg.stream, (w) => w === first, msg);
        break;
      }
      case "ack":
      case "error": {
        const key = msg.ref === undefined || msg.ref === null ? null : refKey(msg.ref);
        const record = key === null ? undefined : this.#records.get(key);
        if (key !== null && record) {
          this.#records.delete(key);
          if (msg.type === "ack") record.resolve(msg);
          else record.reject(new SidecarError(`${record.frame.type} refused: ${msg.code}: ${msg.message}`, msg.code, msg.ref));
        }
        break;
      }
      case "pong":
        this.#pings.shift()?.resolve();
        break;
    }
    for (const inbox of this.#inboxes) inbox.push(msg);
  }

  /** No connection any more: iterators end (or throw `error`), awaited answers reject. */
  #finish(error, rejection = error) {
    if (this.#closed) return;
    this.#closed = true;
    for (const inbox of this.#inboxes) inbox.finish(error);
    this.#inboxes.clear();
    for (const stream of [...this.#ends.keys()]) this.#settle(stream, () => true, rejection);
    for (const r of this.#records.values()) r.reject(rejection);
    this.#records.clear();
    for (const p of this.#pings.splice(0)) p.reject(rejection);
    this.#queued = [];
    if (this.#ws && this.#ws.readyState <= 1) this.#ws.close(1000);
  }
}

/** `url` with `?token=` (a browser's WebSocket cannot send an Authorization header). */
function withToken(url, token) {
  const u = new URL(url);
  u.searchParams.set("token", token);
  return u.toString();
}
