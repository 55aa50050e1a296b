#!/usr/bin/env node
// A gradps worker in JavaScript, written against proto/gradps/v1/*.proto and its comments alone
// (no code of the Python implementation): it joins a coordinator, waits for a run, registers its
// model's initial values, pulls, pushes gradients (codec none or int8), reports metrics, finishes
// and leaves. It trains the `asgd` and `sync` schemes.
//
// Its "model" is a set of named float32 tensors (by default the built-in `mlp` on `digits`, whose
// tensor names and shapes run.proto documents) and its loss is 0.5 * |w - target|^2 / n, a target
// fixed by the run's seed: real gradients of a real loss, without a dataset.
//
//   node worker.js --coordinator HOST:PORT [--codec none|int8] [--tensors JSON] [--out FILE]
//
// --tensors: [{"name": "fc.weight", "shape": [10, 64]}, ...] instead of the mlp's tensors.
// --out: after each run, write the weights of the worker's last pull there as JSON
//   {"run_id": ..., "tensors": {name: {"shape": [...], "float32_le_base64": ...}}}.
// GRADPS_TOKEN (or GRADPS_TOKEN_FILE): the plain worker token of a cluster with a secret.
// GRADPS_TLS_CA: TLS to the coordinator and the shards, their certificates checked against this CA
//   file; GRADPS_TLS_CERT and GRADPS_TLS_KEY: the certificate it presents for mTLS.
// Stock gRPC settings throughout: no raised message limits (the default part size fits them).
'use strict';

const crypto = require('crypto');
const fs = require('fs');
const os = require('os');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

// ---- command line -------------------------------------------------------------------------------

function parseArgs(argv) {
  const args = {
    coordinator: process.env.GRADPS_COORDINATOR || '127.0.0.1:50051',
    codec: 'none',
    tensors: null,
    out: null,
    name: `node-${os.hostname()}-${process.pid}`,
    protoDir: path.resolve(__dirname, '..', '..', 'proto'),
    runs: 1,
    waitS: 120,
    token: '',
    credentials: null,
  };
  const names = {
    '--coordinator': 'coordinator', '--codec': 'codec', '--tensors': 'tensors', '--out': 'out',
    '--name': 'name', '--proto-dir': 'protoDir', '--runs': 'runs', '--wait-s': 'waitS',
  };
  for (let i = 2; i < argv.length; i += 2) {
    const key = names[argv[i]];
    if (!key || i + 1 >= argv.length) throw new Error(`usage: worker.js --coordinator HOST:PORT [options]; bad ${argv[i]}`);
    args[key] = argv[i + 1];
  }
  if (!['none', 'int8'].includes(args.codec)) throw new Error(`--codec must be none or int8, got ${args.codec}`);
  args.runs = Number(args.runs);
  args.waitS = Number(args.waitS);
  args.token = workerToken(process.env);
  args.credentials = channelCredentials(process.env);
  return args;
}

// A file's contents, or an error that names the variable that gave it.
function readNamed(variable, file) {
  try {
    return fs.readFileSync(file);
  } catch (e) {
    throw new Error(`${variable} ${file}: ${e.code === 'ENOENT' ? 'no such file' : e.message}`);
  }
}

function workerToken(env) {
  if ((env.GRADPS_TOKEN || '').trim()) return env.GRADPS_TOKEN.trim();
  const file = (env.GRADPS_TOKEN_FILE || '').trim();
  return file ? readNamed('GRADPS_TOKEN_FILE', file).toString('utf8').trim() : '';
}

// grpc-js gives the address it dials as the TLS server name, an IP address too (127.0.0.1, a pod's),
// which Node warns about once per process (DEP0123); the certificate is checked against that
// address all the same, so the warning says nothing to this worker's user.
const emitWarning = process.emitWarning.bind(process);
process.emitWarning = (warning, ...rest) => {
  const code = typeof rest[0] === 'object' && rest[0] !== null ? rest[0].code : rest[1];
  if (code !== 'DEP0123') emitWarning(warning, ...rest);
};

// TLS when GRADPS_TLS_CA names a CA file (every server's certificate must chain to it), with
// GRADPS_TLS_CERT and GRADPS_TLS_KEY as this worker's certificate for mTLS; else plaintext.
function channelCredentials(env) {
  const [ca, cert, key] = ['GRADPS_TLS_CA', 'GRADPS_TLS_CERT', 'GRADPS_TLS_KEY'].map((v) => (env[v] || '').trim());
  if (!ca) {
    if (cert || key) throw new Error('GRADPS_TLS_CERT and GRADPS_TLS_KEY need GRADPS_TLS_CA: the CA of the services');
    return grpc.credentials.createInsecure();
  }
  if (!cert !== !key) throw new Error('give both GRADPS_TLS_CERT and GRADPS_TLS_KEY, or neither');
  return grpc.credentials.createSsl(
    readNamed('GRADPS_TLS_CA', ca),
    key ? readNamed('GRADPS_TLS_KEY', key) : null,
    cert ? readNamed('GRADPS_TLS_CERT', cert) : null,
  );
}

// ---- the proto ----------------------------------------------------------------------------------

function loadProto(protoDir) {
  const definition = protoLoader.loadSync(['gradps/v1/coordinator.proto', 'gradps/v1/shard.proto'], {
    includeDirs: [protoDir],
    keepCase: true, // field names as in the proto
    longs: Number, // uint64 steps, versions and counts of this worker's runs stay below 2^53
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).gradps.v1;
}

// A unary call as a promise.
function unary(client, method, request, timeoutS, metadata) {
  return new Promise((resolve, reject) => {
    client[method](request, metadata || new grpc.Metadata(), { deadline: Date.now() + timeoutS * 1000 }, (err, res) =>
      err ? reject(err) : resolve(res));
  });
}

// A client-streaming call (Push, RegisterTensors): write every request, then half-close.
function clientStream(client, method, requests, timeoutS, metadata) {
  return new Promise((resolve, reject) => {
    const call = client[method](metadata || new grpc.Metadata(), { deadline: Date.now() + timeoutS * 1000 }, (err, res) =>
      err ? reject(err) : resolve(res));
    for (const r of requests) call.write(r);
    call.end();
  });
}

// A server-streaming call (Pull): every response.
function serverStream(client, method, request, timeoutS, metadata) {
  return new Promise((resolve, reject) => {
    const got = [];
    const call = client[method](request, metadata || new grpc.Metadata(), { deadline: Date.now() + timeoutS * 1000 });
    call.on('data', (m) => got.push(m));
    call.on('error', reject);
    call.on('end', () => resolve(got));
  });
}

// ---- the model ----------------------------------------------------------------------------------

// run.proto: the built-in "mlp" on "digits" (8x8 images, 10 classes): Linear(64, 128), ReLU,
// Linear(128, 64), ReLU, Linear(64, 10), named as torch names them.
const MLP_DIGITS = [
  { name: 'layers.1.weight', shape: [128, 64] },
  { name: 'layers.1.bias', shape: [128] },
  { name: 'layers.3.weight', shape: [64, 128] },
  { name: 'layers.3.bias', shape: [64] },
  { name: 'layers.5.weight', shape: [10, 64] },
  { name: 'layers.5.bias', shape: [10] },
];

const numel = (shape) => shape.reduce((a, b) => a * b, 1);

// mulberry32: a small deterministic generator, seeded per run and tensor.
function generator(seed, name) {
  let h = (Number(seed) ^ 0x9e3779b9) >>> 0;
  for (const c of Buffer.from(name, 'utf8')) h = Math.imul(h ^ c, 0x01000193) >>> 0;
  return () => {
    h = (h + 0x6d2b79f5) >>> 0;
    let t = h;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function filled(seed, name, n, low, high) {
  const next = generator(seed, name);
  const out = new Float32Array(n);
  for (let i = 0; i < n; i++) out[i] = low + (high - low) * next();
  return out;
}

// ---- codecs (tensor.proto: Codec) ---------------------------------------------------------------

// Little-endian float32 bytes of a Float32Array slice (copied: Node's Buffer is little-endian on
// every platform Node runs on, but say so rather than rely on it).
function float32Bytes(values) {
  const out = Buffer.allocUnsafe(values.length * 4);
  for (let i = 0; i < values.length; i++) out.writeFloatLE(values[i], i * 4);
  return out;
}

function readFloat32(payload, count) {
  if (payload.length !== count * 4) throw new Error(`payload of ${payload.length} bytes for ${count} float32 values`);
  const out = new Float32Array(count);
  for (let i = 0; i < count; i++) out[i] = payload.readFloatLE(i * 4);
  return out;
}

const FLT_MIN = 1.1754943508222875e-38;

// Round half to even, as IEEE's default rounding.
function rint(x) {
  const r = Math.round(x);
  return Math.abs(x % 1) === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

// CODEC_INT8: a float32 scale s, then `count` int8 values q; value = q * s (float32). The sender
// chooses s and q; this worker takes s = max|x| / 127 and q = round(x / s), and keeps what the
// rounding lost as an error-feedback residual added to the next gradient of the part.
function encodeInt8(values, residual) {
  const x = new Float32Array(values.length);
  let peak = 0;
  for (let i = 0; i < x.length; i++) {
    x[i] = Math.fround(values[i] + residual[i]);
    peak = Math.max(peak, Math.abs(x[i]));
  }
  let scale = Math.fround(peak / 127);
  const out = Buffer.alloc(4 + x.length);
  if (scale < FLT_MIN) scale = 0;
  out.writeFloatLE(scale, 0);
  const inverse = scale ? Math.fround(1 / scale) : 0;
  for (let i = 0; i < x.length; i++) {
    const q = Math.max(-127, Math.min(127, rint(Math.fround(x[i] * inverse))));
    out.writeInt8(q, 4 + i);
    residual[i] = Math.fround(x[i] - Math.fround(q * scale));
  }
  return out;
}

function encode(codec, values, residual) {
  return codec === 'int8' ? encodeInt8(values, residual) : float32Bytes(values);
}

// ---- one run ------------------------------------------------------------------------------------

class Run {
  constructor(worker, assignment) {
    this.w = worker;
    this.runId = assignment.run_id;
    this.spec = assignment.spec;
    this.rank = assignment.rank;
    this.steps = Number(assignment.total_steps || this.spec.steps);
    if (!this.steps) throw new Error('this worker needs RunSpec.steps (it has no dataset to count epochs over)');
    if (!['asgd', 'sync'].includes(this.spec.scheme)) throw new Error(`scheme ${this.spec.scheme}: this worker trains asgd and sync`);
    this.tensors = worker.tensors.map((t) => ({ ...t, n: numel(t.shape) }));
    this.values = {}; // name -> Float32Array, the replica
    this.target = {};
    for (const t of this.tensors) this.target[t.name] = filled(this.spec.seed, `target:${t.name}`, t.n, -0.5, 0.5);
    this.versions = {}; // `${name}/${index}` -> version of the last pull
    this.residuals = {}; // `${name}/${index}` -> int8 error feedback
    this.traffic = { pushed: 0, pulled: 0, pushes: 0, stalenessSum: 0, stalenessMax: 0, waitS: 0 };
    this.began = Date.now();
  }

  async start() {
    // GetPlacement: the first caller's tensors define the table (every tensor float32).
    const tensors = this.tensors.map((t) => ({ name: t.name, shape: t.shape, dtype: 'DTYPE_FLOAT32' }));
    const r = await this.w.call('GetPlacement', { run_id: this.runId, tensors, total_steps: this.steps, worker_id: this.w.workerId }, 60);
    this.placement = r.placement;
    this.shards = this.placement.shards.map((address) => new this.w.pkg.ShardService(address, this.w.args.credentials));
    this.partsOf = this.placement.shards.map(() => []);
    for (const p of this.placement.parts) this.partsOf[p.shard].push(p);
    // RegisterTensors: initial values of every part, codec none; the first upload of a part wins,
    // so the values this worker pulls next may be another worker's.
    const initial = {};
    for (const t of this.tensors) initial[t.name] = filled(this.spec.seed, `init:${t.name}`, t.n, -0.1, 0.1);
    await Promise.all(this.partsOf.map((parts, s) => parts.length === 0 ? null : clientStream(this.shards[s], 'RegisterTensors',
      parts.map((p) => ({
        run_id: this.runId,
        part_count: parts.length,
        part: this.partMessage(p, 'none', initial[p.name], 0),
      })), 60, this.w.metadata())));
    await this.pull(0);
  }

  partMessage(p, codec, values, version) {
    const slice = values.subarray(Number(p.offset), Number(p.offset) + Number(p.count));
    const key = `${p.name}/${p.index}`;
    if (codec === 'int8' && !this.residuals[key]) this.residuals[key] = new Float32Array(slice.length);
    return {
      name: p.name,
      index: p.index,
      offset: p.offset,
      count: p.count,
      dtype: 'DTYPE_FLOAT32',
      codec: { codec: codec === 'int8' ? 'CODEC_INT8' : 'CODEC_NONE' },
      payload: encode(codec, slice, this.residuals[key]),
      version,
    };
  }

  // Pull every part from every shard; under sync, wait until every part has `minVersion`.
  async pull(minVersion) {
    const began = Date.now();
    const request = { run_id: this.runId, worker_id: this.w.workerId, min_version: minVersion, wait_ms: 60000, codec: { codec: 'CODEC_NONE' } };
    const answers = await Promise.all(this.shards.map((stub, s) => this.partsOf[s].length === 0 ? [] : serverStream(stub, 'Pull', request, 90, this.w.metadata())));
    for (const t of this.tensors) if (!this.values[t.name]) this.values[t.name] = new Float32Array(t.n);
    let got = 0;
    for (const messages of answers) {
      for (const m of messages) {
        for (const part of [m.part, ...m.parts].filter((x) => x && x.name)) {
          if (part.lz4 || part.shared || Number(part.streamed)) throw new Error(`part ${part.name}/${part.index}: lz4, shared or streamed, which this worker never asks for`);
          const values = readFloat32(part.payload, Number(part.count));
          this.values[part.name].set(values, Number(part.offset));
          this.versions[`${part.name}/${part.index}`] = Number(part.version);
          this.traffic.pulled += part.payload.length;
          got++;
        }
      }
    }
    if (got !== this.placement.parts.length) throw new Error(`pulled ${got} parts of ${this.placement.parts.length}`);
    this.traffic.waitS += (Date.now() - began) / 1000;
  }

  gradient() {
    const grads = {};
    let loss = 0;
    let n = 0;
    for (const t of this.tensors) {
      const w = this.values[t.name];
      const target = this.target[t.name];
      const g = new Float32Array(t.n);
      for (let i = 0; i < t.n; i++) {
        g[i] = w[i] - target[i];
        loss += 0.5 * g[i] * g[i];
      }
      n += t.n;
      grads[t.name] = g;
    }
    return { grads, loss: loss / n };
  }

  // One push: every part of every shard, as one call per shard (PushRequest.part_count parts).
  async push(grads, step) {
    const began = Date.now();
    const answers = await Promise.all(this.partsOf.map((parts, s) => {
      if (parts.length === 0) return null;
      const requests = parts.map((p) => {
        const part = this.partMessage(p, this.w.codec, grads[p.name], this.versions[`${p.name}/${p.index}`] || 0);
        this.traffic.pushed += part.payload.length;
        return { run_id: this.runId, worker_id: this.w.workerId, step, part, part_count: parts.length };
      });
      return clientStream(this.shards[s], 'Push', requests, 90, this.w.metadata());
    }));
    for (const a of answers.filter(Boolean)) {
      this.traffic.pushes++;
      this.traffic.stalenessSum += Number(a.staleness);
      this.traffic.stalenessMax = Math.max(this.traffic.stalenessMax, Number(a.staleness));
    }
    this.traffic.waitS += (Date.now() - began) / 1000;
  }

  async train() {
    await this.start();
    const sp = this.spec.scheme_params;
    const nPush = Math.max(1, sp.n_push || 1);
    const nFetch = Math.max(1, sp.n_fetch || 1);
    const lr = this.spec.optimizer.lr;
    const accrued = {};
    for (const t of this.tensors) accrued[t.name] = new Float32Array(t.n);
    let lossSum = 0;
    let lossN = 0;
    let accruedAny = false;
    for (let step = 0; step < this.steps; step++) {
      if (this.w.stopped) throw new Abandoned(`run ${this.runId} was stopped`);
      const { grads, loss } = this.gradient();
      lossSum += loss;
      lossN++;
      if (this.spec.scheme === 'sync') {
        // PushRequest.step: the part's current version (the step pulled); then the next step's weights.
        await this.push(grads, step);
        await this.pull(step + 1);
      } else {
        // asgd: push the accumulated gradient every n_push steps, fetch every n_fetch; between
        // fetches the replica steps on its own with plain SGD.
        for (const t of this.tensors) {
          const a = accrued[t.name];
          const g = grads[t.name];
          const w = this.values[t.name];
          for (let i = 0; i < t.n; i++) {
            a[i] += g[i];
            w[i] = Math.fround(w[i] - lr * g[i]);
          }
        }
        accruedAny = true;
        if ((step + 1) % nPush === 0) {
          await this.push(accrued, step);
          for (const t of this.tensors) accrued[t.name].fill(0);
          accruedAny = false;
        }
        if ((step + 1) % nFetch === 0) await this.pull(0);
      }
      if ((step + 1) % 5 === 0 && step + 1 < this.steps) {
        if ((await this.report(step + 1, lossSum / lossN, false)).stop) throw new Abandoned(`run ${this.runId} was stopped`);
        lossSum = 0;
        lossN = 0;
      }
    }
    if (this.spec.scheme === 'asgd') {
      if (accruedAny) await this.push(accrued, this.steps);
      await this.pull(0); // the final weights, as the shards hold them
    }
    // Metrics.done: after the last step; Metrics.weights_digest: coordinator.proto's layout.
    await this.report(this.steps, lossSum / Math.max(1, lossN), true);
    for (const stub of this.shards) stub.close();
    return this.values;
  }

  digest() {
    const h = crypto.createHash('sha256');
    for (const name of this.tensors.map((t) => t.name).sort(compareUtf8)) {
      h.update(Buffer.from(name, 'utf8'));
      h.update(float32Bytes(this.values[name]));
    }
    return h.digest();
  }

  async report(step, loss, done) {
    const t = this.traffic;
    const metrics = {
      worker_id: this.w.workerId,
      rank: this.rank,
      step,
      loss,
      test_accuracy: -1, // not evaluated
      samples: 0,
      elapsed_s: (Date.now() - this.began) / 1000,
      bytes_pushed: t.pushed,
      bytes_pulled: t.pulled,
      staleness_sum: t.stalenessSum,
      pushes: t.pushes,
      staleness_max: t.stalenessMax,
      wait_s: t.waitS,
      done,
      total_steps: this.steps,
    };
    if (done) metrics.weights_digest = this.digest();
    return this.w.call('ReportMetrics', { run_id: this.runId, metrics }, 30);
  }
}

// Names sorted by their UTF-8 bytes (coordinator.proto: Metrics.weights_digest).
function compareUtf8(a, b) {
  return Buffer.compare(Buffer.from(a, 'utf8'), Buffer.from(b, 'utf8'));
}

class Abandoned extends Error {}

// ---- the worker ---------------------------------------------------------------------------------

class Worker {
  constructor(args) {
    this.args = args;
    this.codec = args.codec;
    this.tensors = args.tensors ? JSON.parse(args.tensors) : MLP_DIGITS;
    this.pkg = loadProto(args.protoDir);
    this.coordinator = new this.pkg.CoordinatorService(args.coordinator, args.credentials);
    this.token = args.token;
    this.runId = '';
    this.stopped = false;
  }

  metadata() {
    const m = new grpc.Metadata();
    if (this.token) m.set('authorization', `Bearer ${this.token}`);
    return m;
  }

  call(method, request, timeoutS) {
    return unary(this.coordinator, method, request, timeoutS, this.metadata());
  }

  async join() {
    const r = await new Promise((resolve, reject) => {
      const call = this.coordinator.JoinWorker({ name: this.args.name, device: 'cpu' }, this.metadata(),
        { deadline: Date.now() + 30000 }, (err, res) => (err ? reject(err) : resolve(res)));
      // With a cluster secret, the coordinator answers the plain worker token with this worker's own.
      call.on('metadata', () => {});
      call.on('status', (status) => {
        const own = status.metadata && status.metadata.get('gradps-worker-token');
        if (own && own.length) this.token = String(own[0]);
      });
    });
    this.workerId = r.worker_id;
    const interval = Math.max(50, r.heartbeat_interval_ms);
    this.heartbeat = setInterval(() => this.beat(interval), interval);
    log(`joined ${this.args.coordinator} as worker ${this.workerId}`);
  }

  beat(interval) {
    this.call('Heartbeat', { worker_id: this.workerId, run_id: this.runId }, Math.max(1, (2 * interval) / 1000))
      .then((r) => {
        if (r.stop || r.rejoin) this.stopped = true;
      })
      .catch(() => {}); // the coordinator's timeout decides
  }

  async assignment() {
    const deadline = Date.now() + this.args.waitS * 1000;
    while (Date.now() < deadline) {
      const r = await this.call('GetAssignment', { worker_id: this.workerId, wait_ms: 10000 }, 20);
      if (r.run_id) return r;
    }
    throw new Error(`no run assigned within ${this.args.waitS} s`);
  }

  async leave() {
    clearInterval(this.heartbeat);
    try {
      await this.call('LeaveWorker', { worker_id: this.workerId }, 2);
    } catch (e) {
      log(`leaving: ${e.message}`);
    }
    this.coordinator.close();
  }

  async serve() {
    await this.join();
    try {
      for (let i = 0; i < this.args.runs; i++) {
        const assignment = await this.assignment();
        this.runId = assignment.run_id;
        this.stopped = false;
        log(`run ${this.runId}: ${assignment.spec.scheme}, rank ${assignment.rank} of ${assignment.workers.length}, codec ${this.codec}`);
        const run = new Run(this, assignment);
        try {
          const values = await run.train();
          if (this.args.out) writeWeights(this.args.out, this.runId, run.tensors, values);
          log(`run ${this.runId} done: ${run.steps} steps`);
        } catch (e) {
          if (e instanceof Abandoned) {
            log(e.message);
          } else {
            const error = `${e.code !== undefined ? grpc.status[e.code] + ': ' : ''}${e.details || e.message}`.slice(0, 2000);
            await this.call('ReportMetrics', { run_id: this.runId, metrics: { worker_id: this.workerId, rank: run.rank, error, test_accuracy: -1 } }, 30).catch(() => {});
            throw e;
          }
        }
        this.runId = '';
      }
    } finally {
      await this.leave();
    }
  }
}

function writeWeights(file, runId, tensors, values) {
  const out = { run_id: runId, tensors: {} };
  for (const t of tensors) out.tensors[t.name] = { shape: t.shape, float32_le_base64: float32Bytes(values[t.name]).toString('base64') };
  fs.writeFileSync(`${file}.tmp`, JSON.stringify(out));
  fs.renameSync(`${file}.tmp`, file);
}

function log(line) {
  process.stderr.write(`${new Date().toISOString()} node-worker ${line}\n`);
}

if (require.main === module) {
  let args;
  try {
    args = parseArgs(process.argv);
  } catch (e) {
    process.stderr.write(`${e.message}\n`);
    process.exit(2);
  }
  new Worker(args).serve().then(
    () => process.exit(0),
    (e) => {
      log(`failed: ${e.code !== undefined ? grpc.status[e.code] + ': ' : ''}${String(e.details || e.message).trim()}`);
      process.exit(1);
    },
  );
}

module.exports = { encodeInt8, MLP_DIGITS };
