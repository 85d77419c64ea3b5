// The paywall's wallet script: connects an EIP-1193 wallet (EIP-6963 discovery, else window.ethereum), switches
// to the offer's chain, signs the offer's payment with eth_signTypedData_v4 as the Go payer builds it, retries
// this URL with the payment header and shows what was bought with its settlement transaction.
(function () {
  "use strict";
  var PERMIT2 = "0x000000000022D473030F116dDEE9F6B43aC78BA3";
  var PROXY = "0x402085c248EeA27D92E8b30b2C58ed07f9E20001";
  var VALID_AFTER_SKEW = 600; // seconds, as the Go payer: a payer clock a little ahead still pays
  var doc = JSON.parse(document.getElementById("x402-payment-required").textContent);
  var header = document.body.getAttribute("data-header") || "PAYMENT-SIGNATURE";
  var status = document.getElementById("x402-status");
  var content = document.getElementById("x402-content");
  var providers = [];
  window.addEventListener("eip6963:announceProvider", function (e) {
    if (e.detail && e.detail.provider) providers.push(e.detail);
  });
  window.dispatchEvent(new Event("eip6963:requestProvider"));

  function say(state, text) {
    status.setAttribute("data-state", state);
    status.textContent = text;
  }
  function fail(text) { var e = new Error(text); e.plain = true; throw e; }
  function wallet() {
    if (providers.length > 0) return providers[0].provider;
    if (window.ethereum && typeof window.ethereum.request === "function") return window.ethereum;
    return null;
  }
  function hex(n) { return "0x" + BigInt(n).toString(16); }
  function word(addr) { return addr.toLowerCase().replace(/^0x/, "").padStart(64, "0"); }
  function randomBytes(n) {
    var b = new Uint8Array(n); crypto.getRandomValues(b);
    return Array.prototype.map.call(b, function (x) { return x.toString(16).padStart(2, "0"); }).join("");
  }
  function units(amount, decimals) {
    var s = BigInt(amount).toString().padStart(decimals + 1, "0");
    var whole = s.slice(0, s.length - decimals), frac = s.slice(s.length - decimals).replace(/0+$/, "");
    return frac ? whole + "." + frac : whole;
  }
  async function call(eth, to, data) {
    var out = await eth.request({ method: "eth_call", params: [{ to: to, data: data }, "latest"] });
    return BigInt(out === "0x" ? 0 : out);
  }
  function b64(obj) {
    var bytes = new TextEncoder().encode(JSON.stringify(obj)), s = "";
    for (var i = 0; i < bytes.length; i++) s += String.fromCharCode(bytes[i]);
    return btoa(s);
  }
  function unb64(s) {
    var bin = atob(s), bytes = new Uint8Array(bin.length);
    for (var i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    return JSON.parse(new TextDecoder().decode(bytes));
  }
  async function sign(eth, from, typed) {
    try {
      return await eth.request({ method: "eth_signTypedData_v4", params: [from, JSON.stringify(typed)] });
    } catch (e) {
      if (e && e.code === 4001) fail("You refused to sign the payment. Nothing was charged.");
      throw e;
    }
  }
  var tokenDomainTypes = [{ name: "name", type: "string" }, { name: "version", type: "string" },
    { name: "chainId", type: "uint256" }, { name: "verifyingContract", type: "address" }];
  function tokenDomain(req, chainId) {
    return { name: (req.extra && req.extra.name) || "Stable Coin", version: (req.extra && req.extra.version) || "1",
      chainId: chainId, verifyingContract: req.asset };
  }

  // payload signs req as the Go payer (chain.SignEIP3009Payment, chain.SignPermit2Payment, chain.AddGasSponsoring).
  async function payload(eth, from, req, chainId) {
    var method = (req.extra && req.extra.assetTransferMethod) || "eip3009";
    var now = Math.floor(Date.now() / 1000);
    var validAfter = String(Math.max(0, now - VALID_AFTER_SKEW));
    var deadline = String(now + (req.maxTimeoutSeconds || 60));
    var out = { x402Version: 2, accepted: req, payload: {} };
    if (doc.resource && doc.resource.url) out.resource = doc.resource;
    if (method === "eip3009") {
      var auth = { from: from, to: req.payTo, value: String(req.amount), validAfter: validAfter, validBefore: deadline,
        nonce: "0x" + randomBytes(32) };
      out.payload.signature = await sign(eth, from, { types: { EIP712Domain: tokenDomainTypes, TransferWithAuthorization: [
        { name: "from", type: "address" }, { name: "to", type: "address" }, { name: "value", type: "uint256" },
        { name: "validAfter", type: "uint256" }, { name: "validBefore", type: "uint256" }, { name: "nonce", type: "bytes32" }] },
        primaryType: "TransferWithAuthorization", domain: tokenDomain(req, chainId), message: auth });
      out.payload.authorization = auth;
      return out;
    }
    if (method !== "permit2" || req.scheme !== "exact") fail("This page cannot sign a " + req.scheme + "/" + method + " payment; use an x402 client.");
    var permit2 = (req.extra && req.extra.permit2Address) || PERMIT2;
    var spender = (req.extra && req.extra.x402Permit2ProxyAddress) || PROXY;
    var p2 = { from: from, permitted: { token: req.asset, amount: String(req.amount) }, spender: spender,
      nonce: BigInt("0x" + randomBytes(32)).toString(), deadline: deadline, witness: { to: req.payTo, validAfter: validAfter } };
    out.payload.signature = await sign(eth, from, { types: {
      EIP712Domain: [{ name: "name", type: "string" }, { name: "chainId", type: "uint256" }, { name: "verifyingContract", type: "address" }],
      PermitWitnessTransferFrom: [{ name: "permitted", type: "TokenPermissions" }, { name: "spender", type: "address" },
        { name: "nonce", type: "uint256" }, { name: "deadline", type: "uint256" }, { name: "witness", type: "Witness" }],
      TokenPermissions: [{ name: "token", type: "address" }, { name: "amount", type: "uint256" }],
      Witness: [{ name: "to", type: "address" }, { name: "validAfter", type: "uint256" }] },
      primaryType: "PermitWitnessTransferFrom", domain: { name: "Permit2", chainId: chainId, verifyingContract: permit2 },
      message: { permitted: p2.permitted, spender: spender, nonce: p2.nonce, deadline: deadline, witness: p2.witness } });
    out.payload.permit2Authorization = p2;
    // Without a Permit2 allowance the facilitator approves Permit2 for the payer with an EIP-2612 permit.
    var allowance = await call(eth, req.asset, "0xdd62ed3e" + word(from) + word(permit2));
    if (allowance < BigInt(req.amount)) {
      var nonce = await call(eth, req.asset, "0x7ecebe00" + word(from));
      var permit = { owner: from, spender: permit2, value: String(req.amount), nonce: nonce.toString(), deadline: deadline };
      var sig = await sign(eth, from, { types: { EIP712Domain: tokenDomainTypes, Permit: [{ name: "owner", type: "address" },
        { name: "spender", type: "address" }, { name: "value", type: "uint256" }, { name: "nonce", type: "uint256" },
        { name: "deadline", type: "uint256" }] }, primaryType: "Permit", domain: tokenDomain(req, chainId), message: permit });
      var ext = (doc.extensions && doc.extensions.eip2612GasSponsoring) ? JSON.parse(JSON.stringify(doc.extensions.eip2612GasSponsoring)) : {};
      ext.info = Object.assign({}, ext.info || {}, { from: from, asset: req.asset, spender: permit2, amount: permit.value,
        nonce: permit.nonce, deadline: deadline, signature: sig, version: "1" });
      out.extensions = { eip2612GasSponsoring: ext };
    }
    return out;
  }

  async function show(resp) {
    var type = resp.headers.get("Content-Type") || "";
    content.textContent = "";
    if (/^text\/html/i.test(type)) {
      var frame = document.createElement("iframe");
      frame.setAttribute("sandbox", "");
      frame.srcdoc = await resp.text();
      content.appendChild(frame);
    } else if (/^(text\/|application\/(json|xml))/i.test(type)) {
      var pre = document.createElement("pre");
      pre.id = "x402-paid";
      pre.textContent = await resp.text();
      content.appendChild(pre);
    } else {
      var a = document.createElement("a");
      a.href = URL.createObjectURL(await resp.blob());
      a.download = "";
      a.textContent = "Download what you paid for";
      content.appendChild(a);
    }
  }

  async function refusal(resp) {
    var why = "";
    try {
      var body = await resp.json();
      why = body.error || body.invalidReason || body.errorReason || "";
      if (body.invalidMessage) why += ": " + body.invalidMessage;
    } catch (e) { why = ""; }
    return "The payment was refused (HTTP " + resp.status + ")" + (why ? ": " + why : "") + ".";
  }

  async function pay(i) {
    var req = doc.accepts[i];
    var eth = wallet();
    if (!eth) fail("No browser wallet was found. Install or enable an Ethereum wallet extension, then reload this page.");
    say("busy", "Connecting your wallet…");
    var accounts;
    try {
      accounts = await eth.request({ method: "eth_requestAccounts" });
    } catch (e) {
      if (e && e.code === 4001) fail("You declined to connect your wallet. Nothing was charged.");
      throw e;
    }
    if (!accounts || accounts.length === 0) fail("Your wallet shared no account.");
    var from = accounts[0];
    var chainId = Number(req.network.split(":")[1]);
    if (!/^eip155:\d+$/.test(req.network)) fail("This page pays on EVM networks only, not " + req.network + ".");
    if (Number(await eth.request({ method: "eth_chainId" })) !== chainId) {
      say("busy", "Asking your wallet to switch to " + req.network + "…");
      try {
        await eth.request({ method: "wallet_switchEthereumChain", params: [{ chainId: hex(chainId) }] });
      } catch (e) {
        if (e && e.code === 4902) fail("Your wallet does not know the network " + req.network + " (chain " + chainId + "). Add it to your wallet, then pay again.");
        fail("Your wallet is on another network and did not switch to " + req.network + " (chain " + chainId + ").");
      }
      if (Number(await eth.request({ method: "eth_chainId" })) !== chainId) fail("Your wallet is still on another network than " + req.network + ".");
    }
    var balance = await call(eth, req.asset, "0x70a08231" + word(from));
    var decimals = Number(document.querySelector("[data-offer='" + i + "']").getAttribute("data-decimals") || "6");
    if (balance < BigInt(req.amount)) {
      fail("Too little balance: " + from + " holds " + units(balance, decimals) + " " + ((req.extra && req.extra.name) || "tokens") +
        " and this costs " + units(req.amount, decimals) + ". Nothing was charged.");
    }
    say("busy", "Sign the payment in your wallet…");
    var signed = await payload(eth, from, req, chainId);
    say("busy", "Paying…");
    var headers = {};
    headers[header] = b64(signed);
    var resp = await fetch(location.href, { headers: headers, cache: "no-store", credentials: "same-origin" });
    if (!resp.ok) fail(await refusal(resp));
    var tx = "";
    var pr = resp.headers.get("PAYMENT-RESPONSE") || resp.headers.get("X-PAYMENT-RESPONSE");
    if (pr) { try { tx = unb64(pr).transaction || ""; } catch (e) { tx = ""; } }
    await show(resp);
    say("paid", tx ? "Paid. Transaction " + tx : "Paid; the settlement is on its way.");
    if (tx) status.setAttribute("data-transaction", tx);
  }

  Array.prototype.forEach.call(document.querySelectorAll("button.x402-pay"), function (b) {
    b.addEventListener("click", function () {
      var buttons = document.querySelectorAll("button.x402-pay");
      Array.prototype.forEach.call(buttons, function (x) { x.disabled = true; });
      pay(Number(b.getAttribute("data-offer"))).catch(function (e) {
        say("error", e && e.plain ? e.message : "Something went wrong: " + ((e && e.message) || e));
      }).finally(function () {
        if (status.getAttribute("data-state") !== "paid") Array.prototype.forEach.call(buttons, function (x) { x.disabled = false; });
      });
    });
  });
})();
