// llama.cpp's side of the peer benchmark, through node-llama-cpp (pinned by
// run.sh).  Prints one JSON object: prefill tokens/s per prompt length and
// decode tokens/s per batch, measured like ds41-bench measures them:
//   prefill  one prompt of P random ids in one evaluation (logits of the last
//            position only), after an untimed warm-up prompt of the same size
//   decode   B sequences of one context, 32-token prompts, then `steps` greedy
//            steps; node-llama-cpp batches the B pending tokens of a step into
//            one llama_decode.  The first step is a warm-up; the clock runs
//            from the moment every sequence has its first token to the moment
//            every sequence has steps + 1.
// The generated ids are returned too (the proof that the model runs).
//
// usage: node llama_bench.mjs --model FILE [--threads N] [--batches 1,4,16]
//        --vocab N [--prompts 64,512] [--steps N] [--seed N]
// (run from a directory whose node_modules holds node-llama-cpp: run.sh copies it there)
import {getLlama, LlamaLogLevel} from "node-llama-cpp";

function parseArgs(argv) {
    const o = {threads: 2, batches: [1, 4, 16], prompts: [64, 512], steps: 8, seed: 1};
    for (let i = 0; i < argv.length; i++) {
        const a = argv[i], v = argv[i + 1];
        const list = (s) => s.split(",").map((x) => {
            const n = Number(x);
            if (!Number.isInteger(n) || n <= 0) throw new Error(`${a}: '${s}' is not a list of positive integers`);
            return n;
        });
        if (a === "--model") o.model = v;
        else if (a === "--threads") o.threads = list(v)[0];
        else if (a === "--batches") o.batches = list(v);
        else if (a === "--prompts") o.prompts = list(v);
        else if (a === "--steps") o.steps = list(v)[0];
        else if (a === "--seed") o.seed = list(v)[0];
        else if (a === "--vocab") o.vocab = list(v)[0];
        else throw new Error(`unknown argument '${a}'`);
        i++;
    }
    if (!o.model || !o.vocab) throw new Error("--model FILE and --vocab N are required");
    return o;
}

// The same LCG as ds41-bench's random_id (any id of the vocabulary).
function makeRng(seed) {
    let s = BigInt.asUintN(64, 0x9e3779b97f4a7c15n + BigInt(seed));
    return (vocab) => {
        s = BigInt.asUintN(64, s * 6364136223846793005n + 1442695040888963407n);
        return Number((s >> 33n) % BigInt(vocab));
    };
}

const now = () => Number(process.hrtime.bigint()) / 1e9;

async function prefill(model, o, P, rnd, vocab) {
    const context = await model.createContext({contextSize: P + 64, sequences: 1, batchSize: P, threads: o.threads});
    let seconds = 0;
    for (let pass = 0; pass < 2; pass++) {
        const seq = context.getSequence();
        const ids = Array.from({length: P}, () => rnd(vocab));
        const t0 = now();
        await seq.evaluateWithoutGeneratingNewTokens(ids);
        seconds = now() - t0;
        seq.dispose();
    }
    await context.dispose();
    return {tokens: P, seconds, tokens_per_s: P / seconds};
}

async function decode(model, o, B, rnd, vocab) {
    const prompt = 32;
    const context = await model.createContext({
        contextSize: prompt + o.steps + 32, sequences: B, batchSize: Math.max(B * prompt, 64), threads: o.threads,
    });
    const seqs = Array.from({length: B}, () => context.getSequence());
    const prompts = seqs.map(() => Array.from({length: prompt}, () => rnd(vocab)));
    const counts = new Array(B).fill(0);
    const generated = seqs.map(() => []);
    let firstDone = 0, t0 = 0, t1 = 0;
    await Promise.all(seqs.map(async (seq, b) => {
        for await (const tok of seq.evaluate(prompts[b], {temperature: 0})) {
            generated[b].push(tok);
            counts[b]++;
            if (counts[b] === 1 && ++firstDone === B) t0 = now();
            if (counts[b] === o.steps + 1) break;
        }
    }));
    t1 = now();
    await context.dispose();
    const seconds = t1 - t0;
    return {batch: B, steps: o.steps, seconds_per_step: seconds / o.steps, tokens_per_s: (B * o.steps) / seconds,
            generated: generated.map((g) => g.length), sample: generated[0].slice(0, 8)};
}

async function main() {
    const o = parseArgs(process.argv.slice(2));
    const llama = await getLlama({gpu: false, build: "never", maxThreads: o.threads, logLevel: LlamaLogLevel.error});
    const model = await llama.loadModel({modelPath: o.model, gpuLayers: 0});
    const vocab = o.vocab;
    const rnd = makeRng(o.seed);
    const out = {threads: o.threads, llama_cpp_build: llama.llamaCppRelease ?? null, cpu: llama.cpuMathCores,
                 prefill: [], decode: []};
    for (const P of o.prompts) out.prefill.push(await prefill(model, o, P, rnd, vocab));
    for (const B of o.batches) out.decode.push(await decode(model, o, B, rnd, vocab));
    await model.dispose();
    await llama.dispose();
    process.stdout.write(JSON.stringify(out) + "\n");
}

main().catch((e) => {
    process.stderr.write(`llama_bench: ${e && e.stack ? e.stack : e}\n`);
    process.exit(1);
});
