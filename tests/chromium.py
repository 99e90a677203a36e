"""A headless Chromium driven over the Chrome DevTools protocol, with the standard library only.

`--remote-debugging-pipe` makes Chromium read protocol commands from its file descriptor 3 and write replies to 4,
as JSON messages ended by a NUL byte: no websocket, no driver binary, no Python package. Chromium is the system's
(Debian's `chromium` package); `CHROMIUM` names it, and `available()` says whether it is installed.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time

CHROMIUM = "/usr/bin/chromium"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars")

#: The text of the page, shadow roots included (tensorboard's Polymer dashboards keep theirs there), of the element
#: `arguments[0]` names (a tag name), or of the whole document; style and script text left out.
DEEP_TEXT = r"""(selector) => {
  const out = [];
  const walk = (node) => {
    if (node.nodeType === Node.TEXT_NODE) { out.push(node.textContent); return; }
    if (node.nodeName === 'STYLE' || node.nodeName === 'SCRIPT') return;
    if (node.shadowRoot) walk(node.shadowRoot);
    for (const child of node.childNodes) walk(child);
  };
  const find = (node) => {
    if (node.nodeType === Node.ELEMENT_NODE && node.localName === selector) return node;
    for (const child of [...(node.shadowRoot ? [node.shadowRoot] : []), ...node.childNodes]) {
      const hit = find(child);
      if (hit) return hit;
    }
    return null;
  };
  if (!document.documentElement) return null;  // between two pages
  const root = selector ? find(document.documentElement) : document.documentElement;
  if (!root) return null;
  walk(root);
  return out.join(' ').replace(/\s+/g, ' ').trim();
}"""


def available() -> bool:
    """Whether the system's Chromium is installed."""
    return os.access(CHROMIUM, os.X_OK)


class Chromium:
    """One headless browser with one page, `width` x `height` CSS pixels; a context manager that closes it."""

    def __init__(self, width: int = 1600, height: int = 1000, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.profile = tempfile.mkdtemp(prefix="chromium_profile_")  # a new, empty profile every time
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # away from 3 and 4, which the shell below fills with them
        to_browser_r, from_browser_w = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (to_browser_r,
                                                                                            from_browser_w)]
        script = f'exec 3<&{to_browser_r} 4>&{from_browser_w} {to_browser_r}<&- {from_browser_w}>&-; exec "$0" "$@"'
        self.process = subprocess.Popen(
            ["/bin/bash", "-c", script, CHROMIUM, *FLAGS, f"--user-data-dir={self.profile}",
             "--remote-debugging-pipe", f"--window-size={width},{height}", "about:blank"],
            pass_fds=(to_browser_r, from_browser_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer, self._id, self._session = b"", 0, None
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.send("Page.enable")
        self.send("Runtime.enable")
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def send(self, method: str, **params) -> dict:
        """Send one protocol command (to the page once attached) and return its result."""
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if self._session is not None and not method.startswith(("Target.", "Browser.")):
            message["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout_s
        while True:
            while b"\0" not in self._buffer:
                ready, _, _ = select.select([self._from_browser], [], [], max(deadline - time.monotonic(), 0))
                if not ready:
                    raise TimeoutError(f"Chromium did not answer {method} in {self.timeout_s:.0f} s")
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"Chromium exited (code {self.process.poll()}) before answering {method}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def open(self, url: str) -> None:
        """Load `url` afresh (through a blank page: a new fragment alone would not reload a single-page app)."""
        self.send("Page.navigate", url="about:blank")
        self.send("Page.navigate", url=url)

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"JavaScript error: {result['exceptionDetails']}")
        return result["result"].get("value")

    def text(self, element: str = "") -> str | None:
        """The text of element `element` (a tag name, searched through shadow roots) or of the page (`DEEP_TEXT`);
        None when there is no such element."""
        return self.evaluate(f"({DEEP_TEXT})({json.dumps(element)})")

    def wait_for(self, predicate, timeout_s: float = 30.0, poll_s: float = 0.25, what: str = "the page"):
        """Poll `predicate(self)` until it returns something true, and return that."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate(self)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not shown within {timeout_s:.0f} s")
            time.sleep(poll_s)

    def scroll_to(self, text: str) -> bool:
        """Scroll the first element whose own text is `text` (shadow roots searched) to the top of the page; whether
        there was one."""
        return self.evaluate(f"""(() => {{
          const find = (node) => {{
            if (node.nodeType === Node.ELEMENT_NODE && [...node.childNodes].some(
                c => c.nodeType === Node.TEXT_NODE && c.textContent.trim() === {json.dumps(text)})) return node;
            for (const child of [...(node.shadowRoot ? [node.shadowRoot] : []), ...node.childNodes]) {{
              const hit = find(child);
              if (hit) return hit;
            }}
            return null;
          }};
          const hit = find(document.documentElement);
          if (hit) hit.scrollIntoView({{block: 'start'}});
          return !!hit;
        }})()""")

    def screenshot(self, path: str) -> None:
        """Save the page's viewport as a PNG."""
        data = self.send("Page.captureScreenshot", format="png")["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self) -> None:
        """Close the browser and remove its profile."""
        if self.process.poll() is None:
            try:
                self.send("Browser.close")
                self.process.wait(10)
            except (OSError, RuntimeError, TimeoutError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)
