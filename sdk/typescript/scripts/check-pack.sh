#!/bin/sh
# `npm pack` makes a tarball that installs into a fresh project, imports as ESM, and
# type-checks a consumer against its .d.ts files.
set -eu
cd "$(dirname "$0")/.."
sdk=$(pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tarball=$(npm pack --silent --pack-destination "$tmp" | tail -n 1)
echo "packed $tarball:"
tar -tzf "$tmp/$tarball" | sed 's/^/  /'
if tar -tzf "$tmp/$tarball" | grep -Eq '^package/(src|test|dist-test|node_modules)/'; then
  echo "the tarball holds sources or tests" >&2
  exit 1
fi
mkdir "$tmp/consumer"
cd "$tmp/consumer"
printf '{"name":"consumer","version":"0.0.0","private":true,"type":"module"}\n' > package.json
npm install --silent --no-audit --no-fund "$tmp/$tarball"
if [ -n "$(npm ls --omit=dev --parseable --all 2>/dev/null | grep -v -e "$tmp/consumer\$" -e 'node_modules/idem-sdk$')" ]; then
  echo "the package pulled in runtime dependencies" >&2
  npm ls --all >&2
  exit 1
fi
cat > smoke.mjs <<'JS'
import { Client, Worker, IdempotencyConflictError, IdemError, Succeeded } from "idem-sdk";
const client = new Client("http://127.0.0.1:1", "key");
new Worker(client, { executorId: "smoke", handlers: { "payment.release": { execute: () => new Succeeded({}), reconcile: () => { throw new Error(); } } } });
if (!(new IdempotencyConflictError("x") instanceof IdemError)) throw new Error("error classes");
console.log("import ok:", client.baseUrl.href);
JS
node smoke.mjs
cat > consumer.ts <<'TS'
import { Client, NotCommitted, type Handler, type Task } from "idem-sdk";
const client: Client = new Client("http://127.0.0.1:1", "key");
const handler: Handler = { execute: (ctx) => ({ task: ctx.taskId }), reconcile: () => new NotCommitted() };
export async function first(): Promise<Task | undefined> {
  for await (const t of client.list({ state: "queued" })) return t;
  return handler ? undefined : undefined;
}
TS
printf '{"compilerOptions":{"module":"NodeNext","moduleResolution":"NodeNext","target":"ES2022","strict":true,"noEmit":true,"skipLibCheck":false,"types":[]},"files":["consumer.ts"]}\n' > tsconfig.json
"$sdk/node_modules/.bin/tsc" -p tsconfig.json
echo "types ok"
