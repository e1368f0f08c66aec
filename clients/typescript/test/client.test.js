// The client against a real `sidecar serve` on 127.0.0.1, started here with the small model
// (all-minilm-l6-v2) and fixtures/catalogs/notes.json, on a store of its own.
//
//   node --test                          (Node.js 22+)
//   node --experimental-websocket --test (Node.js 20)
//
// SIDECAR_PYTHON names the Python that runs `-m sidecar` (default: the clone's .venv, else python3).

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { existsSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

import { SidecarClient, SidecarError, VERSION } from "../src/index.js";

const ROOT = resolve(fileURLToPath(import.meta.url), "../../../..");
const VENV = join(ROOT, ".venv", "bin", "python");
const PYTHON = process.env.SIDECAR_PYTHON || (existsSync(VENV) ? VENV : "python3");
const LOAD_MS = 120_000; // the model loads in about a second; the first run may fetch it (46 MB)
const ASK = "search my notes for the kubernetes setup";
const NARRATION = "I'll search your notes for the kubernetes setup. One moment.";
const CHITCHAT = "Sure, happy to help with that. What else do you need?";

/** A `sidecar serve` process: resolves with it once its log says where it listens. */
function serve(port, store) {
  const args = ["-m", "sidecar", "serve", "--host", "127.0.0.1", "--port", String(port), "--model", "all-minilm-l6-v2",
                "--catalog", join(ROOT, "fixtures", "catalogs", "notes.json"), "--store", store];
  const proc = spawn(PYTHON, args, { cwd: ROOT, env: { ...process.env, PYTHONUNBUFFERED: "1" }, stdio: ["ignore", "pipe", "pipe"] });
  let log = "";
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => fail(`not listening within ${LOAD_MS} ms`), LOAD_MS);
    const fail = (why) => {
      clearTimeout(timer);
      proc.kill("SIGKILL");
      reject(new Error(`sidecar serve ${why}; its log:\n${log}`));
    };
    const read = (chunk) => {
      log += chunk;
      const found = /listening on (ws:\/\/\S+)/.exec(log);
      if (found) {
        clearTimeout(timer);
        resolve({ proc, url: found[1], log: () => log });
      }
    };
    proc.stdout.setEncoding("utf8").on("data", read);
    proc.stderr.setEncoding("utf8").on("data", read);
    proc.on("error", (e) => fail(`could not start (${PYTHON}): ${e.message}`));
    proc.on("exit", (code) => fail(`exited with ${code} before listening`));
  });
}

/** SIGTERM (it finishes in-flight work and closes with 1001), SIGKILL after 30 s. */
function stop(proc) {
  if (proc.exitCode !== null || proc.signalCode !== null) return Promise.resolve();
  return new Promise((resolve) => {
    const timer = setTimeout(() => proc.kill("SIGKILL"), 30_000);
    proc.once("exit", () => {
      clearTimeout(timer);
      resolve();
    });
    proc.kill("SIGTERM");
  });
}

/** A reply split as an LLM streams it: a word and the whitespace after it. */
const tokens = (text) => text.match(/\s*\S+\s*|\s+/g) ?? [];

/** The messages of `stream` (and any without one) until its `ended`. By next(), not for-await:
 * leaving a for-await loop calls return(), which ends the iterator. */
async function untilEnded(iterator, stream) {
  const got = [];
  for (;;) {
    const { value: msg, done } = await iterator.next();
    if (done) throw new Error(`the client ended before stream ${stream}'s ended`);
    if (msg.type === "ended" && msg.stream === stream) return got;
    if (!("stream" in msg) || msg.stream === stream) got.push(msg);
  }
}

/** `promise`, or a failure naming `what` after `ms` (a lost answer fails the test, not hangs it). */
function within(promise, what, ms = 30_000) {
  let timer;
  const late = new Promise((_, reject) => { timer = setTimeout(() => reject(new Error(`no ${what} within ${ms} ms`)), ms); });
  return Promise.race([promise, late]).finally(() => clearTimeout(timer));
}

const names = (inject) => inject.tools.map((t) => t.definition.name);

let dir;
let server;

before(async () => {
  dir = mkdtempSync(join(tmpdir(), "sidecar-ts-"));
  server = await serve(0, join(dir, "sidecar.db"));
});

after(async () => {
  if (server) await stop(server.proc);
  if (dir) rmSync(dir, { recursive: true, force: true });
});

test("connect says hello and gets ready; a refused hello rejects with the sidecar's code", async () => {
  const client = await SidecarClient.connect(server.url, { session: "ts-hello" });
  try {
    assert.equal(client.ready.type, "ready");
    assert.equal(client.ready.version, VERSION);
    assert.equal(client.ready.model, "all-minilm-l6-v2");
    assert.ok(client.ready.tools.includes("semantic_search"), client.ready.tools.join(", "));
    assert.match(client.ready.resume, /^[A-Za-z0-9_-]{16,64}$/);
    await client.ping();
  } finally {
    await client.close();
  }
  await assert.rejects(SidecarClient.connect(server.url, { session: "ts-bad", tools: ["no_such_tool"] }),
                       (e) => e instanceof SidecarError && e.code === "unknown_tool");
});

test("a user turn yields an inject", async () => {
  const client = await SidecarClient.connect(server.url, { session: "ts-user" });
  try {
    const injects = client.injects("turn-1"); // made before the turn is sent: it sees what follows
    client.user("turn-1", ASK);
    const ended = client.end("turn-1");
    let first;
    for await (const inject of injects) {
      first = inject;
      break;
    }
    assert.deepEqual((await ended).type, "ended");
    assert.equal(first.type, "inject");
    assert.equal(first.stream, "turn-1");
    assert.equal(names(first)[0], "semantic_search", JSON.stringify(first));
    assert.ok(["auto", "confirm"].includes(first.tier));
    assert.equal(first.trigger.text, ASK.slice(first.trigger.start, first.trigger.end));
    assert.equal(first.sent_at, ASK.length); // a user turn: all of it was received
  } finally {
    await client.close();
  }
});

test("a streamed reply's narration yields an inject; chit-chat yields none", async () => {
  const client = await SidecarClient.connect(server.url, { session: "ts-reply" });
  try {
    const all = client.messages();
    for (const piece of tokens(NARRATION)) {
      client.token("reply-1", piece);
      await new Promise((r) => setTimeout(r, 5)); // as a model streams it, not in one frame
    }
    await client.end("reply-1");
    const reply = (await untilEnded(all, "reply-1")).filter((m) => m.type === "inject");
    assert.equal(reply.length, 1, JSON.stringify(reply));
    assert.equal(names(reply[0])[0], "semantic_search");
    assert.ok(NARRATION.includes(reply[0].trigger.text), reply[0].trigger.text);
    assert.ok(reply[0].trigger.end <= reply[0].sent_at && reply[0].sent_at <= NARRATION.length);

    for (const piece of tokens(CHITCHAT)) client.token("reply-2", piece);
    await client.end("reply-2");
    const chat = await untilEnded(all, "reply-2");
    assert.deepEqual(chat.filter((m) => m.type !== "decision"), [], "chit-chat injected something");
    await all.return();
  } finally {
    await client.close();
  }
});

test("a reconnect resumes: a record resent under the same ref counts once, also across a restart of the sidecar", async () => {
  const client = await SidecarClient.connect(server.url, { session: "ts-resume", reconnectWaitMs: LOAD_MS });
  try {
    const first = await client.toolResult({ tool: "semantic_search", ok: true, latency_ms: 84.5, ref: "r-1" });
    assert.equal(first.type, "ack");
    assert.equal(first.ref, "r-1");
    const auto = await client.feedback({ tool: "semantic_search", rating: 4, selected: true });
    assert.match(String(auto.ref), /^ts-/); // the client's own ref
    const key = client.ready.resume;

    const ready = await client.reconnect();
    assert.equal(client.connections, 2);
    assert.equal(ready.resume, key);
    const again = await client.toolResult({ tool: "semantic_search", ok: true, latency_ms: 84.5, ref: "r-1" });
    assert.equal(again.id, first.id, "the resent tool_result was stored twice");
    await assert.rejects(client.toolResult({ tool: "semantic_search", ok: false, latency_ms: 9, ref: "r-1" }),
                         (e) => e instanceof SidecarError && e.code === "ref_reused");

    // The sidecar dies (kill -9) with a tool_result unread in its socket, and comes back on the
    // same port and store: the client reconnects by itself, resends the unacknowledged record,
    // and sends what was sent while it was away.
    const port = new URL(server.url).port;
    server.proc.kill("SIGSTOP");
    const pending = client.toolResult({ tool: "read_note", ok: true, latency_ms: 12, ref: "r-2" });
    await new Promise((r) => setTimeout(r, 100));
    const died = new Promise((r) => server.proc.once("exit", r));
    server.proc.kill("SIGKILL");
    await died;
    while (client.connected) await new Promise((r) => setTimeout(r, 10)); // it saw the loss
    const injects = client.injects("turn-2");
    client.user("turn-2", ASK);
    const ended = client.end("turn-2");
    server = await serve(port, join(dir, "sidecar.db"));
    const second = await within(pending, "ack of the tool_result unread when the sidecar died");
    assert.equal(second.ref, "r-2");
    assert.equal((await within(ended, "ended of the turn sent while reconnecting")).stream, "turn-2");
    assert.equal(client.connections, 3);
    assert.equal(client.ready.resume, key);
    const { value } = await injects.next();
    assert.equal(names(value)[0], "semantic_search");
    const resent = await client.toolResult({ tool: "semantic_search", ok: true, latency_ms: 84.5, ref: "r-1" });
    assert.equal(resent.id, first.id, "the new process did not honour the resumed refs");
  } finally {
    await client.close();
  }
  assert.ok(client.closed);
  assert.throws(() => client.user("t", "x"), (e) => e.code === "closed");
});
