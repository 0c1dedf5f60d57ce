#!/usr/bin/env python3
"""Opens pages in one headless Chromium and writes what each left behind.

Usage: browse.py CHROMIUM OUTDIR [--shot NAME] NAME=URL ...

For each NAME=URL, in order, in a new tab of one browser (a Chromium start
costs 1.7 s and two cores' worth of CPU; tests/viz_test.sh opens several
reports): waits until the page says it is done (<body data-done="1">, 60 s
at most), then writes OUTDIR/NAME.dom (document.documentElement.outerHTML,
as --dump-dom prints it), OUTDIR/NAME.log (one "CONSOLE" line per console
message, uncaught exception or browser log entry, as --enable-logging
prints console messages) and, for --shot NAME, OUTDIR/NAME.png (the
viewport of a 1400 x 1000 window). A page that never finishes is still written, with a
line saying so in its log: the caller's checks decide.

Talks to the browser over the DevTools protocol on a pipe
(--remote-debugging-pipe: the browser reads commands on fd 3 and writes
replies and events on fd 4, each a JSON text ended by a NUL byte). Exit 0
once every page is written; 1 when the browser cannot start or dies.
"""
import base64
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time

WIDTH, HEIGHT = 1400, 1000
PAGE_S = 60


class Browser:
    def __init__(self, chromium, profile):
        to_browser_r, self.to_browser = os.pipe()
        self.from_browser, from_browser_w = os.pipe()

        def fds():  # the child's fd 3 reads our commands, fd 4 writes to us
            r, w = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10), fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)
            os.dup2(r, 3)  # dup2 leaves the copies inheritable
            os.dup2(w, 4)

        self.proc = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             f"--user-data-dir={profile}", "--host-resolver-rules=MAP * ~NOTFOUND",
             f"--window-size={WIDTH},{HEIGHT}", "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(os.path.join(profile, "stderr"), "w"),
            preexec_fn=fds, close_fds=False)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self.buf = b""
        self.next_id = 0
        self.events = []

    def _read(self, deadline):
        while b"\0" not in self.buf:
            if time.monotonic() > deadline:
                raise TimeoutError("the browser did not answer in time")
            chunk = os.read(self.from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("the browser closed its pipe (exit %s)" % self.proc.poll())
            self.buf += chunk
        text, self.buf = self.buf.split(b"\0", 1)
        return json.loads(text)

    def call(self, method, params=None, session=None, timeout=60):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.to_browser, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def close(self):
        try:
            self.call("Browser.close", timeout=10)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def console_lines(events, session):
    """The page's console messages, exceptions and log entries, one line each."""
    out = []
    for e in events:
        if e.get("sessionId") != session:
            continue
        p = e.get("params", {})
        if e.get("method") == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
            out.append(f"CONSOLE {p.get('type')}: {text}")
        elif e.get("method") == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            out.append(f"CONSOLE exception: {d.get('text')} {d.get('exception', {}).get('description', '')}")
        elif e.get("method") == "Log.entryAdded":
            entry = p.get("entry", {})
            out.append(f"CONSOLE log {entry.get('level')} ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}")
    return [line.replace("\n", " ") for line in out]


def open_page(browser, out, name, url, shot):
    target = browser.call("Target.createTarget", {"url": "about:blank", "newWindow": True, "width": WIDTH, "height": HEIGHT})["targetId"]
    session = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Runtime", "Log", "Page"):
        browser.call(f"{domain}.enable", session=session)
    browser.call("Page.navigate", {"url": url}, session=session)
    notes = []
    deadline = time.monotonic() + PAGE_S
    while time.monotonic() < deadline:
        done = browser.call("Runtime.evaluate", {"expression": "document.readyState === 'complete' && "
                                                 "document.body ? document.body.dataset.done || '' : ''",
                                                 "returnByValue": True}, session=session)["result"].get("value")
        if done == "1":
            break
        time.sleep(0.05)
    else:
        notes.append(f"browse.py: the page did not say it was done within {PAGE_S} s")
    dom = browser.call("Runtime.evaluate", {"expression": "document.documentElement.outerHTML",
                                            "returnByValue": True}, session=session)["result"].get("value", "")
    with open(os.path.join(out, name + ".dom"), "w") as f:
        f.write(dom)
    if shot:
        png = browser.call("Page.captureScreenshot", {"format": "png"}, session=session)["data"]
        with open(os.path.join(out, name + ".png"), "wb") as f:
            f.write(base64.b64decode(png))
    with open(os.path.join(out, name + ".log"), "w") as f:
        f.write("".join(line + "\n" for line in console_lines(browser.events, session) + notes))
    browser.call("Target.closeTarget", {"targetId": target})


def main(argv):
    if len(argv) < 3:
        raise SystemExit(__doc__)
    chromium, out, rest = argv[1], argv[2], argv[3:]
    shots, pages = set(), []
    while rest:
        if rest[0] == "--shot" and len(rest) > 1:
            shots.add(rest[1])
            rest = rest[2:]
            continue
        name, sep, url = rest[0].partition("=")
        if not sep:
            raise SystemExit(f"browse.py: {rest[0]}: expected NAME=URL")
        pages.append((name, url))
        rest = rest[1:]
    with tempfile.TemporaryDirectory() as profile:
        browser = Browser(chromium, profile)
        try:
            for name, url in pages:
                open_page(browser, out, name, url, name in shots)
        except (RuntimeError, TimeoutError, OSError) as e:
            err = open(os.path.join(profile, "stderr"), errors="replace").read()
            print(f"browse.py: {e}\n{err[-2000:]}", file=sys.stderr)
            browser.proc.kill()
            return 1
        browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
