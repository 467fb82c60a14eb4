// Opens a WebSocket from a page in headless Chromium (Debian's), for
// crates/quill/tests/requests.rs, which starts the server (quill with TLS, HTTP/2, in
// front of a small HTTP/1.1 WebSocket server) and judges what this script saw. The page
// is loaded first, so the WebSocket can go over the page's HTTP/2 connection when the
// server allows it (RFC 8441). Prints one line "REPORT <json>" and exits 0, or
// "FAIL <why>" and exits 1.
//
// What the report holds:
//   page:      the page's protocol (Resource Timing's nextHopProtocol)
//   echoed:    the messages that came back, in order
//   errors:    exceptions and console errors of the page
//
// Environment: PAGE_URL, CERT (the server's certificate, PEM), CHROMIUM (executable),
// PROFILE_DIR (a fresh user data directory).
import { fail, launch } from "./launch.mjs";

const url = process.env.PAGE_URL;
const deadline = 30_000;

const context = await launch();

try {
  const page = context.pages()[0] ?? (await context.newPage());
  const errors = [];
  page.on("pageerror", (e) => errors.push(e.message));
  page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
  await page.goto(url, { timeout: deadline });
  const report = await page.evaluate(async (deadline) => {
    const nav = performance.getEntriesByType("navigation")[0];
    const echoed = await new Promise((resolve, reject) => {
      const got = [];
      const ws = new WebSocket(location.origin.replace("https:", "wss:") + "/ws");
      const timer = setTimeout(() => reject(new Error("no echo within the deadline")), deadline);
      ws.onopen = () => { ws.send("first"); ws.send("second"); };
      ws.onmessage = (m) => {
        got.push(m.data);
        if (got.length === 2) { clearTimeout(timer); ws.close(); resolve(got); }
      };
      ws.onerror = () => { clearTimeout(timer); reject(new Error("the WebSocket failed")); };
    });
    return { page: nav.nextHopProtocol, echoed };
  }, deadline);
  report.errors = errors;
  console.log("REPORT " + JSON.stringify(report));
} catch (e) {
  fail(e);
} finally {
  await context.close();
}
