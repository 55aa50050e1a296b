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
  refused PERMISSION_DENIED when a request names another worker id.

Tokens travel as `authorization: Bearer <token>` metadata on every call (`open_channel`), are
compared with `hmac.compare_digest` and never logged. Health checks (grpc.health.v1) stay open.
"""
