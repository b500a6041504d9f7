#!/usr/bin/python3
"""A fuzzing HTTP client for ds41d: N requests over its Unix socket (keep-alive connections, a few
threads) with mutated JSON bodies (byte flips, truncation, wrong types, unknown fields, huge
numbers, invalid UTF-8, deep nesting, oversized bodies) and broken framing (bad chunked encoding,
garbage request lines, bodies shorter than Content-Length).  Every answer must be a 2xx or 4xx
(never 5xx), or a closed connection for broken framing, which may also be answered 505 (an
unknown HTTP version).  Prints one JSON summary line: {"requests", "answered", "by_status" (JSON
requests), "framing_status" (broken framing), "closed", "bad": [first few problems]}.

usage: fuzz_client.py SOCKET N SEED"""
import json
import random
import socket
import sys
import threading

SOCK, N, SEED = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

BASES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
                              "max_tokens": 1, "temperature": 0.5, "stop": ["x"], "seed": 3,
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("/v1/completions", {"prompt": "abc", "max_tokens": 2}),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1, "logprobs": 2}),
    ("/tokenize", {"content": "hello"}),
    ("/detokenize", {"tokens": [5, 6, 7]}),
]
ODD_VALUES = [None, True, False, -1, 0, 1e308, -1e308, 2**63, -(2**63), 1.5, "", "x" * 300, [], {}, [[[]]],
              {"a": {"b": {"c": 1}}}, "\udcff", "\u0000", 99999999999]


def mutate_json(rng, obj):
    obj = json.loads(json.dumps(obj))
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(6)
        if kind == 0 and obj:  # change a value's type
            k = rng.choice(list(obj))
            obj[k] = rng.choice(ODD_VALUES)
        elif kind == 1:  # unknown field
            obj["f%d" % rng.randrange(100)] = rng.choice(ODD_VALUES)
        elif kind == 2 and obj:  # drop a field
            del obj[rng.choice(list(obj))]
        elif kind == 3 and "messages" in obj and isinstance(obj["messages"], list) and obj["messages"]:
            m = obj["messages"][0]
            if isinstance(m, dict):
                m[rng.choice(["role", "content", "name", "tool_calls", "x"])] = rng.choice(ODD_VALUES + ["assistant", "tool"])
        elif kind == 4:  # nesting
            obj["messages"] = [[[[[[[[{}]]]]]]]] if rng.random() < 0.5 else obj.get("messages")
        else:  # numbers at the edges
            obj[rng.choice(["max_tokens", "temperature", "top_p", "seed", "top_logprobs", "n"])] = rng.choice(
                [0, -5, 2**40, 3.7, 1e400 if False else 1e300, "1"])
    text = json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")
    r = rng.random()
    if r < 0.15:  # byte flips
        b = bytearray(text)
        for _ in range(rng.randint(1, 4)):
            if b:
                b[rng.randrange(len(b))] = rng.randrange(256)
        text = bytes(b)
    elif r < 0.25:  # truncation
        text = text[: rng.randrange(len(text) + 1)]
    elif r < 0.28:  # invalid UTF-8 inside a string
        text = text.replace(b'"hi"', b'"\xff\xfe\xc0"')
    return text


def read_response(f):
    line = f.readline()
    if not line:
        return None, True
    parts = line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise ValueError("bad status line %r" % line[:80])
    status = int(parts[1])
    length, chunked, close = None, False, False
    while True:
        h = f.readline()
        if not h:
            return status, True
        if h in (b"\r\n", b"\n"):
            break
        k, _, v = h.decode("latin-1").partition(":")
        k, v = k.strip().lower(), v.strip().lower()
        if k == "content-length":
            length = int(v)
        elif k == "transfer-encoding" and "chunked" in v:
            chunked = True
        elif k == "connection" and "close" in v:
            close = True
    if chunked:
        while True:
            size = int(f.readline().split(b";")[0], 16)
            f.read(size + 2) if size else f.readline()
            if not size:
                break
    elif length is not None:
        f.read(length)
    return status, close


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.answered, self.closed, self.by_status, self.framing_status, self.bad = 0, 0, {}, {}, []

    def add(self, status, framing):
        with self.lock:
            self.answered += 1
            table = self.framing_status if framing else self.by_status
            table[status] = table.get(status, 0) + 1
            allowed = status < 500 or (framing and status == 505)
            if not allowed and len(self.bad) < 5:
                self.bad.append("status %d%s" % (status, " (framing)" if framing else ""))

    def problem(self, what):
        with self.lock:
            if len(self.bad) < 5:
                self.bad.append(what)


def worker(index, count, stats):
    rng = random.Random(SEED * 1000 + index)
    conn, f = None, None
    for i in range(count):
        if conn is None:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(60)
            conn.connect(SOCK)
            f = conn.makefile("rb")
        r = rng.random()
        framing = False
        if r < 0.03:  # broken framing on a connection of its own
            framing = True
            req = rng.choice([
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n",
                b"GARBAGE\r\n\r\n",
                b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n",
                b"GET /health HTTP/9.9\r\n\r\n",
                b"POST /tokenize HTTP/1.1\r\nHost: x\r\n" + b"X-A: " + b"a" * 70000 + b"\r\n\r\n",
            ])
        elif r < 0.05:  # oversized body (the daemon's limit is small in this test)
            req = (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                   % (200000)) + b"{" + b" " * 199999
        else:
            path, base = rng.choice(BASES)
            body = mutate_json(rng, base)
            method = "POST" if rng.random() > 0.02 else rng.choice(["GET", "PUT", "DELETE"])
            req = ("%s %s HTTP/1.1\r\nHost: ds41\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                   % (method, path, len(body))).encode() + body
        try:
            try:
                conn.sendall(req)
            except BrokenPipeError:
                pass  # an oversized body is answered (413) and the connection closed before it is all sent
            status, close = read_response(f)
            if status is None:
                if not framing:
                    stats.problem("closed without an answer (request %d of worker %d)" % (i, index))
                with stats.lock:
                    stats.closed += 1
                close = True
            else:
                stats.add(status, framing)
                if framing and status < 400:
                    stats.problem("broken framing answered %d" % status)
        except (OSError, ValueError) as e:
            with stats.lock:
                stats.closed += 1
            if not framing:
                stats.problem("request %d of worker %d: %s" % (i, index, e))
            close = True
        if close or framing:
            try:
                conn.close()
            except OSError:
                pass
            conn = None


def main():
    stats = Stats()
    threads = []
    per = N // 4
    for t in range(4):
        th = threading.Thread(target=worker, args=(t, per if t < 3 else N - 3 * per, stats))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    print(json.dumps({"requests": N, "answered": stats.answered, "closed": stats.closed,
                      "by_status": {str(k): v for k, v in sorted(stats.by_status.items())},
                      "framing_status": {str(k): v for k, v in sorted(stats.framing_status.items())}, "bad": stats.bad}))


main()
