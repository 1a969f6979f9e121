// A TypeScript client of skyrl-grpc: streams a generation through the router with an
// x-session-id, then pauses, checks and resumes one engine server. Prints one JSON object.
//
//   npx tsx client.ts <router host:port> <server host:port> <comma-separated prompt ids> <max tokens>
import { createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import { DataPlane } from "./gen/skyrl/inference/v1/data_plane_pb.js";
import { ControlPlane, PauseMode } from "./gen/skyrl/inference/v1/control_plane_pb.js";
import { FinishReason } from "./gen/skyrl/inference/v1/generation_pb.js";

const [routerAddress, serverAddress, promptArg, maxTokensArg] = process.argv.slice(2);

function transport(address: string) {
  return createGrpcTransport({ baseUrl: `http://${address}` });
}

async function main(): Promise<void> {
  const data = createClient(DataPlane, transport(routerAddress));
  const tokens: number[] = [];
  let finishReason = FinishReason.UNSPECIFIED;
  const stream = data.generateStream(
    {
      promptTokenIds: promptArg.split(",").map(Number),
      samplingParams: { temperature: 0, maxTokens: Number(maxTokensArg), ignoreEos: true },
    },
    { headers: { "x-session-id": "typescript-session" } },
  );
  for await (const chunk of stream) {
    tokens.push(...chunk.tokenIds);
    if (chunk.finishReason !== FinishReason.UNSPECIFIED) finishReason = chunk.finishReason;
  }

  const control = createClient(ControlPlane, transport(serverAddress));
  await control.pause({ mode: PauseMode.KEEP });
  const pausedAfterPause = (await control.isPaused({})).paused;
  await control.resume({});
  const pausedAfterResume = (await control.isPaused({})).paused;

  console.log(
    JSON.stringify({
      tokens,
      finishReason: FinishReason[finishReason],
      pausedAfterPause,
      pausedAfterResume,
    }),
  );
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
