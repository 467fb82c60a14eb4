// What the browser tests share: starting Debian's headless Chromium the same way for every
// script, and the one way a script reports that it could not do its work.
//
// Environment: CHROMIUM (executable), PROFILE_DIR (a fresh user data directory); CERT
// (optional): the server's self-signed certificate (PEM), trusted by its key; NETLOG
// (optional, for debugging): a file for Chromium's net log, every socket and its bytes.
import { chromium } from "playwright-core";
import { X509Certificate, createHash } from "node:crypto";
import { readFileSync } from "node:fs";

/** Prints "FAIL <why>" on one line (what the Rust side looks for) and exits 1. */
export function fail(why) {
  console.log("FAIL " + String(why).split("\n").join(" | "));
  process.exit(1);
}

/**
 * A persistent Chromium context in PROFILE_DIR. With CERT set, Chromium trusts that
 * certificate's key, and only that (the SHA-256 of its SubjectPublicKeyInfo): ignoring
 * certificate errors instead would cost extra connections (Chromium first fails the
 * handshake, then asks again), which tests that count connections would see.
 * `options` go to Playwright as they are (e.g. a viewport). Fails the script if
 * Chromium does not start.
 */
export async function launch(options = {}) {
  const args = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
  ];
  if (process.env.CERT) {
    const spki = createHash("sha256")
      .update(new X509Certificate(readFileSync(process.env.CERT)).publicKey.export({ type: "spki", format: "der" }))
      .digest("base64");
    args.unshift("--ignore-certificate-errors-spki-list=" + spki);
  }
  if (process.env.NETLOG) {
    args.push("--log-net-log=" + process.env.NETLOG, "--net-log-capture-mode=Everything");
  }
  return chromium
    .launchPersistentContext(process.env.PROFILE_DIR, {
      executablePath: process.env.CHROMIUM,
      headless: true,
      ...options,
      args,
    })
    .catch(fail);
}
