// The paywall's wallet script: connects an EIP-1193 wallet (EIP-6963 discovery, else window.ethereum), switches
// to the offer's chain (adding it when the wallet does not know it), signs the offer's payment with
// eth_signTypedData_v4 as the Go payer builds it (exact by eip3009, permit2 or erc2612, upto by permit2), retries this URL
// with the payment header and shows what was bought with its settlement transaction; or, where the route grants
// access, signs the sign-in-with-x message (personal_sign) and retries with SIGN-IN-WITH-X.
//
// It signs nothing but what the offer on this page says: the offer's amount, to the offer's payee, on the offer's
// chain (checked right before each signature), for the canonical Permit2 and x402 proxies only.
(function () {
  "use strict";
  var PERMIT2 = "0x000000000022D473030F116dDEE9F6B43aC78BA3";
  var PROXY = "0x402085c248EeA27D92E8b30b2C58ed07f9E20001";
  var UPTO_PROXY = "0x4020A4f3b7b90ccA423B9fabCc0CE57C6C240002";
  var VALID_AFTER_SKEW = 600; // seconds, as the Go payer: a payer clock a little ahead still pays
  var doc = JSON.parse(document.getElementById("x402-payment-required").textContent);
  var chainsEl = document.getElementById("x402-chains");
  var chains = chainsEl ? JSON.parse(chainsEl.textContent || "{}") : {};
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
  function isAddress(a) { return typeof a === "string" && /^0x[0-9a-fA-F]{40}$/.test(a); }
  function same(a, b) { return String(a).toLowerCase() === String(b).toLowerCase(); }
  // onChain refuses to go on when the wallet has moved off the chain the offer pays on.
  async function onChain(eth, chainId, network) {
    if (Number(await eth.request({ method: "eth_chainId" })) !== chainId) {
      fail("Your wallet is on another network than " + network + " (chain " + chainId + "); nothing was signed.");
    }
  }
  async function sign(eth, from, typed) {
    await onChain(eth, typed.domain.chainId, "the offer's");
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

  // payload signs req as the Go payer (chain.SignEIP3009Payment, chain.SignERC2612Payment, chain.SignPermit2Payment,
  // chain.AddGasSponsoring).
  async function payload(eth, from, req, chainId) {
    var method = (req.extra && req.extra.assetTransferMethod) || "eip3009";
    var now = Math.floor(Date.now() / 1000);
    var validAfter = String(Math.max(0, now - VALID_AFTER_SKEW));
    var deadline = String(now + (req.maxTimeoutSeconds || 60));
    var out = { x402Version: 2, accepted: req, payload: {} };
    if (doc.resource && doc.resource.url) out.resource = doc.resource;
    if (method === "eip3009") {
      if (req.scheme !== "exact") fail("This page cannot sign a " + req.scheme + "/eip3009 payment; use an x402 client.");
      var auth = { from: from, to: req.payTo, value: String(req.amount), validAfter: validAfter, validBefore: deadline,
        nonce: "0x" + randomBytes(32) };
      out.payload.signature = await sign(eth, from, { types: { EIP712Domain: tokenDomainTypes, TransferWithAuthorization: [
        { name: "from", type: "address" }, { name: "to", type: "address" }, { name: "value", type: "uint256" },
        { name: "validAfter", type: "uint256" }, { name: "validBefore", type: "uint256" }, { name: "nonce", type: "bytes32" }] },
        primaryType: "TransferWithAuthorization", domain: tokenDomain(req, chainId), message: auth });
      out.payload.authorization = auth;
      return out;
    }
    if (method === "erc2612") {
      // An EIP-2612 permit lets its spender move the amount anywhere: only to a named wallet (the facilitator's
      // settlement wallet, extra.spender), of exactly the offer's amount of the offer's token, on its chain.
      if (req.scheme !== "exact") fail("This page cannot sign a " + req.scheme + "/erc2612 payment; use an x402 client.");
      var permitSpender = req.extra && req.extra.spender;
      if (!isAddress(permitSpender) || /^0x0{40}$/.test(permitSpender)) fail("The erc2612 offer names no wallet to spend its permit: not signed.");
      if (!/^\d+$/.test(String(req.amount)) || BigInt(req.amount) === 0n) fail("The erc2612 offer names no amount: not signed.");
      var tokenNonce = await call(eth, req.asset, "0x7ecebe00" + word(from));
      var erc = { owner: from, spender: permitSpender, value: String(req.amount), nonce: tokenNonce.toString(), deadline: deadline };
      out.payload.signature = await sign(eth, from, { types: { EIP712Domain: tokenDomainTypes, Permit: [{ name: "owner", type: "address" },
        { name: "spender", type: "address" }, { name: "value", type: "uint256" }, { name: "nonce", type: "uint256" },
        { name: "deadline", type: "uint256" }] }, primaryType: "Permit", domain: tokenDomain(req, chainId), message: erc });
      out.payload.authorization = { from: from, to: permitSpender, value: erc.value, validAfter: validAfter, validBefore: deadline,
        nonce: erc.nonce };
      return out;
    }
    if (method !== "permit2" || (req.scheme !== "exact" && req.scheme !== "upto")) fail("This page cannot sign a " + req.scheme + "/" + method + " payment; use an x402 client.");
    var upto = req.scheme === "upto";
    // Only the canonical contracts: a signature for another spender could move the payment anywhere.
    var permit2 = (req.extra && req.extra.permit2Address) || PERMIT2;
    var spender = (req.extra && req.extra.x402Permit2ProxyAddress) || (upto ? UPTO_PROXY : PROXY);
    if (!same(permit2, PERMIT2)) fail("The offer names Permit2 at " + permit2 + ", not the canonical " + PERMIT2 + ": not signed.");
    if (!same(spender, upto ? UPTO_PROXY : PROXY)) fail("The offer names the x402 proxy " + spender + ", not the canonical one: not signed.");
    var witness = { to: req.payTo, validAfter: validAfter };
    var witnessType = [{ name: "to", type: "address" }, { name: "validAfter", type: "uint256" }];
    if (upto) {
      var facilitator = req.extra && req.extra.facilitatorAddress;
      if (!isAddress(facilitator)) fail("The upto offer names no facilitator address to settle it: not signed.");
      witness = { to: req.payTo, facilitator: facilitator, validAfter: validAfter };
      witnessType = [{ name: "to", type: "address" }, { name: "facilitator", type: "address" }, { name: "validAfter", type: "uint256" }];
    }
    var p2 = { from: from, permitted: { token: req.asset, amount: String(req.amount) }, spender: spender,
      nonce: BigInt("0x" + randomBytes(32)).toString(), deadline: deadline, witness: witness };
    out.payload.signature = await sign(eth, from, { types: {
      EIP712Domain: [{ name: "name", type: "string" }, { name: "chainId", type: "uint256" }, { name: "verifyingContract", type: "address" }],
      PermitWitnessTransferFrom: [{ name: "permitted", type: "TokenPermissions" }, { name: "spender", type: "address" },
        { name: "nonce", type: "uint256" }, { name: "deadline", type: "uint256" }, { name: "witness", type: "Witness" }],
      TokenPermissions: [{ name: "token", type: "address" }, { name: "amount", type: "uint256" }],
      Witness: witnessType },
      primaryType: "PermitWitnessTransferFrom", domain: { name: "Permit2", chainId: chainId, verifyingContract: permit2 },
      message: { permitted: p2.permitted, spender: spender, nonce: p2.nonce, deadline: deadline, witness: witness } });
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

  // refusal says why the gate refused a payment: the HTTP status and the reason its body names (the 402's error,
  // the facilitator's reason and message), and whether anything was charged.
  async function refusal(resp) {
    var why = "", after = "";
    try {
      var body = await resp.json();
      why = body.error || body.invalidReason || body.errorReason || "";
      if (body.invalidMessage) why += ": " + body.invalidMessage;
      if (typeof body.retry === "string" && body.retry) after = " " + body.retry.charAt(0).toUpperCase() + body.retry.slice(1) + ".";
    } catch (e) { why = ""; }
    // A 402 or 400 answers a payment that was not taken: nothing moved.
    if (!after && (resp.status === 402 || resp.status === 400)) after = " Nothing was charged.";
    return "The payment was refused (HTTP " + resp.status + ")" + (why ? ": " + String(why).replace(/[.\s]+$/, "") : "") + "." + after;
  }

  // connect asks the wallet for its account.
  async function connect() {
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
    if (!accounts || accounts.length === 0 || !isAddress(accounts[0])) fail("Your wallet shared no account.");
    return { eth: eth, from: accounts[0] };
  }

  // toChain has the wallet on network: switched to it, or added (EIP-3085, with the RPC URL this site gives for
  // it) when the wallet does not know it.
  async function toChain(eth, network) {
    if (!/^eip155:\d+$/.test(network)) fail("This page pays on EVM networks only, not " + network + ".");
    var chainId = Number(network.split(":")[1]);
    if (Number(await eth.request({ method: "eth_chainId" })) === chainId) return chainId;
    say("busy", "Asking your wallet to switch to " + network + "…");
    try {
      await eth.request({ method: "wallet_switchEthereumChain", params: [{ chainId: hex(chainId) }] });
    } catch (e) {
      if (!(e && (e.code === 4902 || (e.data && e.data.originalError && e.data.originalError.code === 4902)))) {
        if (e && e.code === 4001) fail("You declined to switch your wallet to " + network + " (chain " + chainId + "). Nothing was charged.");
        fail("Your wallet is on another network and did not switch to " + network + " (chain " + chainId + ")" +
          (e && e.message ? ": " + e.message : "") + ". Nothing was charged.");
      }
      var add = chains[network];
      if (!add) fail("Your wallet does not know the network " + network + " (chain " + chainId + ") and this site names no RPC URL for it. Add it to your wallet, then pay again.");
      say("busy", "Asking your wallet to add " + add.chainName + " (" + network + ")…");
      try {
        await eth.request({ method: "wallet_addEthereumChain", params: [{ chainId: hex(chainId), chainName: add.chainName,
          rpcUrls: add.rpcUrls, nativeCurrency: add.nativeCurrency }] });
      } catch (e2) {
        if (e2 && e2.code === 4001) fail("You declined to add " + add.chainName + " (" + network + ") to your wallet. Nothing was charged.");
        fail("Your wallet did not add the network " + network + ": " + ((e2 && e2.message) || e2) + ".");
      }
      if (Number(await eth.request({ method: "eth_chainId" })) !== chainId) {
        try {
          await eth.request({ method: "wallet_switchEthereumChain", params: [{ chainId: hex(chainId) }] });
        } catch (e3) {
          fail("Your wallet added " + network + " but did not switch to it (chain " + chainId + ").");
        }
      }
    }
    if (Number(await eth.request({ method: "eth_chainId" })) !== chainId) fail("Your wallet is still on another network than " + network + ".");
    return chainId;
  }

  async function pay(i) {
    var req = doc.accepts[i];
    if (!req) fail("There is no offer " + i + " on this page.");
    var w = await connect(), eth = w.eth, from = w.from;
    var chainId = await toChain(eth, req.network);
    var balance = await call(eth, req.asset, "0x70a08231" + word(from));
    var button = document.querySelector("[data-offer='" + i + "']");
    var decimals = Number((button && button.getAttribute("data-decimals")) || "6");
    var token = (req.extra && req.extra.name) || "tokens";
    var upto = req.scheme === "upto";
    if (balance < BigInt(req.amount)) {
      fail("Too little balance: " + from + " holds " + units(balance, decimals) + " " + token +
        " and this costs " + (upto ? "up to " : "") + units(req.amount, decimals) + ". Nothing was charged.");
    }
    say("busy", upto ? "Sign in your wallet a payment of up to " + units(req.amount, decimals) + " " + token + "; you are charged what the request uses…"
      : "Sign the payment in your wallet…");
    var signed = await payload(eth, from, req, chainId);
    say("busy", "Paying…");
    var headers = {};
    headers[header] = b64(signed);
    var resp = await fetch(location.href, { headers: headers, cache: "no-store", credentials: "same-origin" });
    if (!resp.ok) fail(await refusal(resp));
    var tx = "", charged = null;
    var pr = resp.headers.get("PAYMENT-RESPONSE") || resp.headers.get("X-PAYMENT-RESPONSE");
    if (pr) {
      try {
        var settled = unb64(pr);
        tx = typeof settled.transaction === "string" && /^0x[0-9a-fA-F]{64}$/.test(settled.transaction) ? settled.transaction : "";
        if (typeof settled.amount === "string" && /^\d+$/.test(settled.amount)) charged = settled.amount;
      } catch (e) { tx = ""; }
    }
    await show(resp);
    var what = "Paid";
    if (upto && charged !== null) {
      what = "Paid " + units(charged, decimals) + " " + token + " of up to " + units(req.amount, decimals);
      status.setAttribute("data-charged", charged);
    }
    say("paid", tx ? what + ". Transaction " + tx : (upto && charged === "0" ? what + "; nothing to settle." : what + "; the settlement is on its way."));
    if (tx) status.setAttribute("data-transaction", tx);
  }

  // siwxMessage is the EIP-4361 message of a sign-in, as x402.SignInWithX.Message and the SDK's client write it.
  function siwxMessage(s) {
    var m = s.domain + " wants you to sign in with your Ethereum account:\n" + s.address + "\n\n";
    if (s.statement !== undefined) m += s.statement + "\n";
    m += "\nURI: " + s.uri + "\nVersion: " + s.version + "\nChain ID: " + s.chainId.split(":")[1] +
      "\nNonce: " + s.nonce + "\nIssued At: " + s.issuedAt;
    if (s.expirationTime) m += "\nExpiration Time: " + s.expirationTime;
    if (s.notBefore) m += "\nNot Before: " + s.notBefore;
    if (s.requestId !== undefined) m += "\nRequest ID: " + s.requestId;
    if (s.resources) {
      m += "\nResources:";
      for (var i = 0; i < s.resources.length; i++) m += "\n- " + s.resources[i];
    }
    return m;
  }
  function utf8hex(text) {
    var bytes = new TextEncoder().encode(text), out = "0x";
    for (var i = 0; i < bytes.length; i++) out += bytes[i].toString(16).padStart(2, "0");
    return out;
  }

  // signIn answers the route's sign-in-with-x challenge with the wallet's EIP-191 signature: no payment.
  async function signIn() {
    var decl = doc.extensions && doc.extensions["sign-in-with-x"];
    if (!decl || !decl.info) fail("This page offers no sign-in.");
    var info = decl.info;
    // A challenge for another site would sign the person in there: refused, as the SDK's client refuses it.
    if (info.domain !== location.host) fail("The sign-in is for " + info.domain + ", not this site: not signed.");
    var uri;
    try { uri = new URL(info.uri); } catch (e) { fail("The sign-in names no URL: not signed."); }
    if (uri.origin !== location.origin) fail("The sign-in is for " + uri.origin + ", not this site: not signed.");
    var w = await connect(), eth = w.eth, from = w.from;
    var current = "eip155:" + Number(await eth.request({ method: "eth_chainId" }));
    var offered = (decl.supportedChains || []).filter(function (c) { return c.type === "eip191" && /^eip155:\d+$/.test(c.chainId); });
    if (offered.length === 0) fail("This site takes a sign-in on no chain this page can sign for.");
    var chain = offered.find(function (c) { return c.chainId === current; }) || offered[0];
    if (chain.chainId !== current) await toChain(eth, chain.chainId);
    var s = { domain: info.domain, address: from, uri: info.uri, version: info.version, chainId: chain.chainId, type: "eip191",
      nonce: info.nonce, issuedAt: info.issuedAt };
    if (info.statement) s.statement = info.statement;
    if (info.expirationTime) s.expirationTime = info.expirationTime;
    if (info.notBefore) s.notBefore = info.notBefore;
    if (info.requestId !== undefined && info.requestId !== null) s.requestId = info.requestId;
    if (info.resources && info.resources.length) s.resources = info.resources;
    say("busy", "Sign the sign-in message in your wallet (no payment)…");
    try {
      s.signature = await eth.request({ method: "personal_sign", params: [utf8hex(siwxMessage(s)), from] });
    } catch (e) {
      if (e && e.code === 4001) fail("You refused to sign in. Nothing was charged.");
      throw e;
    }
    say("busy", "Signing in…");
    var resp = await fetch(location.href, { headers: { "SIGN-IN-WITH-X": b64(s) }, cache: "no-store", credentials: "same-origin" });
    if (!resp.ok) {
      var why = await refusal(resp);
      fail(why.replace("The payment was refused", "The sign-in was refused") + " Pay to get access.");
    }
    await show(resp);
    say("paid", "Signed in as " + from + ": no payment, nothing charged.");
    status.setAttribute("data-signed-in", from);
  }

  function wire(selector, action) {
    Array.prototype.forEach.call(document.querySelectorAll(selector), function (b) {
      b.addEventListener("click", function () {
        var buttons = document.querySelectorAll("button.x402-pay, button.x402-signin");
        Array.prototype.forEach.call(buttons, function (x) { x.disabled = true; });
        action(b).catch(function (e) {
          say("error", e && e.plain ? e.message : "Something went wrong: " + ((e && e.message) || e));
        }).finally(function () {
          if (status.getAttribute("data-state") !== "paid") Array.prototype.forEach.call(buttons, function (x) { x.disabled = false; });
        });
      });
    });
  }
  wire("button.x402-pay", function (b) { return pay(Number(b.getAttribute("data-offer"))); });
  wire("button.x402-signin", function () { return signIn(); });
})();
