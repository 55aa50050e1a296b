"""Who may call what: bearer tokens with roles, checked by one server interceptor.

A cluster has one secret, which only the coordinator and the shards hold. Every token is derived
from it: `gradps1.<subject>.<HMAC-SHA256(secret, subject)>`, where the subject is a role (`admin`,
`shard`, `worker`) or one worker (`worker-7`). Any service that knows the secret checks any token
with one HMAC and no table, and the coordinator mints a worker's own token at JoinWorker without
telling anyone. A caller holds only its token, and a token grants only its role:

- `admin` (the CLI, the SDK, the coordinator towards the shards): every call.
- `shard`: RegisterShard and ShardHeartbeat.
- `worker`: JoinWorker only. Its answer carries, in the trailing metadata `gradps-worker-token`,
  the token of the worker id it was given, `worker-<id>`, which makes every other call a worker
  makes (heartbeat, assignment, placement, metrics; pull, push, rounds, segments, streams) and is
  refused PERMISSION_DENIED when a request names another worker id, or a run that worker is not
  in (the handlers ask `access.acting_worker`; a heartbeat or report naming such a run is told to
  abandon it).

Tokens travel as `authorization: Bearer <token>` metadata on every call (`open_channel`), are
compared with `hmac.compare_digest` and never logged. Health checks (grpc.health.v1) stay open.

TLS is beside the tokens, not instead of them: `tls` (credentials and `ssl` contexts from PEM
files, reloaded when they change), `tls_socket` (a data stream's TLS connection), `certs`
(`gradps certs`: a CA and the certificates).

`limits`: at most `--max-calls-per-caller` (default 64) calls of one caller in flight at once (a
worker over all its connections, else one connection), RESOURCE_EXHAUSTED beyond.
"""
