// How a chat frontend uses the client (type-checked with tsconfig.json; see README.md).
import { SidecarClient, SidecarError, type Inject } from "@intent-sidecar/client";

export async function chat(url: string, userTurn: string, reply: AsyncIterable<string>): Promise<Inject[]> {
  const sidecar = await SidecarClient.connect(url, { session: "chat-42", agent: "support-bot" });
  const got: Inject[] = [];
  const watching = (async () => {
    for await (const inject of sidecar.injects()) {
      got.push(inject); // hand inject.tools[].definition to the model
      console.log(inject.tier, inject.tools.map((t) => `${t.definition.name} ${t.relevance.toFixed(2)}`));
    }
  })();
  sidecar.user("turn-1", userTurn);
  await sidecar.end("turn-1");
  for await (const delta of reply) sidecar.token("reply-1", delta);
  await sidecar.end("reply-1");
  try {
    const ack = await sidecar.toolResult({ tool: "semantic_search", ok: false, latency_ms: 1200, error: "timeout" });
    for (const s of ack.fallback_suggestions ?? []) console.log("instead:", s.tool, s.reason);
  } catch (e) {
    if (e instanceof SidecarError && e.code === "store_busy") console.log("resend later");
    else throw e;
  }
  await sidecar.close();
  await watching;
  return got;
}
