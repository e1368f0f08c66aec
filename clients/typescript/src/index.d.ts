// Types of index.js. The messages' types are in protocol.d.ts, generated from sidecar/protocol.py.

import type { Ack, Ended, Feedback, Inject, Ready, Ref, ServerMessage, ToolResult } from "./protocol.js";

export * from "./protocol.js";

/** What `SidecarClient.connect` says in its hello, and how it connects. */
export interface ConnectOptions {
  /** hello.session: the client's name for the conversation. */
  session: string;
  /** hello.agent: picks the A/B arm and the agent's own track record. */
  agent?: string;
  /** hello.project: tools tagged for other projects are skipped. */
  project?: string;
  /** hello.permissions: globs of the tools the session may be offered. */
  permissions?: string[];
  /** hello.tools: a string keeps that server tool, an object is an MCP tool definition added to the session. */
  tools?: (string | Record<string, unknown>)[];
  /** hello.decisions: a `decision` message for every judged span. */
  decisions?: boolean;
  /** hello.resume: an earlier connection's `ready.resume`, so its refs carry over. */
  resume?: string;
  /** The sidecar's shared token, sent as `?token=` (a browser's WebSocket sends no headers). */
  token?: string;
  /** How long `connect` retries while the sidecar is unreachable or loading (503); default 30000. */
  waitMs?: number;
  /** `false`: a lost connection ends the client. Default: it reconnects with hello.resume. */
  reconnect?: boolean;
  /** How long a reconnect retries before the client gives up; default 30000. */
  reconnectWaitMs?: number;
  /** A WebSocket class, where the platform has no global one. */
  WebSocket?: new (url: string) => WebSocket;
}

export type SidecarErrorCode = "connect_failed" | "disconnected" | "closed" | "bad_frame" | "bad_url" | (string & {});

/** The sidecar refused something (`code` is the protocol's error code), or the connection was
 * lost (`disconnected`), closed (`closed`) or never made (`connect_failed`) before the answer. */
export declare class SidecarError extends Error {
  readonly code: SidecarErrorCode;
  readonly ref: Ref | null;
  constructor(message: string, code: SidecarErrorCode, ref?: Ref | null);
}

export declare class SidecarClient implements AsyncIterable<ServerMessage> {
  /** Connects, says hello and waits for `ready`; retries while the sidecar is unreachable or loading. */
  static connect(url: string, options: ConnectOptions): Promise<SidecarClient>;
  private constructor(url: string, options: ConnectOptions);
  /** The current connection's `ready` (`ready.resume` is the key a reconnect resumes). */
  readonly ready: Ready;
  /** How many connections this client has opened (1 until a reconnect). */
  readonly connections: number;
  /** Whether `close()` was called or the connection was lost for good. */
  readonly closed: boolean;
  /** Whether a connection is open and ready now (false while reconnecting: frames then wait). */
  readonly connected: boolean;
  /** A user turn, judged whole. Sent at once, or once a reconnect is done. */
  user(stream: string, text: string): void;
  /** An increment of the LLM's reply, any size. */
  token(stream: string, delta: string): void;
  /** Ends a stream; resolves with its `ended` once everything sent on it is judged and its injects delivered. */
  end(stream: string): Promise<Ended>;
  /** One call of a tool; resolves with its `ack` once stored. Without `ref` the client makes one. */
  toolResult(result: Omit<ToolResult, "type">): Promise<Ack>;
  /** A rating of a tool; resolves with its `ack` once stored. */
  feedback(feedback: Omit<Feedback, "type">): Promise<Ack>;
  /** Resolves at the sidecar's `pong`. */
  ping(): Promise<void>;
  /** The injects that arrive from now on (on `stream` only, if given), across reconnects. */
  injects(stream?: string): AsyncIterableIterator<Inject>;
  /** Every sidecar message that arrives from now on (`ready` aside). */
  messages(): AsyncIterableIterator<ServerMessage>;
  [Symbol.asyncIterator](): AsyncIterableIterator<ServerMessage>;
  /** A new connection that resumes this one: unacknowledged records are resent and count once. */
  reconnect(): Promise<Ready>;
  /** Closes the connection: iterators end, awaited answers reject with `closed`. */
  close(): Promise<void>;
}
