// batch-vectors.mjs signs and verifies batch-settlement payments with the public TypeScript x402 SDK
// (@x402/evm's batch-settlement client and facilitator), pinned by this folder's package-lock.json. Three jobs:
//
//   node batch-vectors.mjs sign   < spec.json    prints the payments the SDK's client signs
//   node batch-vectors.mjs verify < items.json   prints the SDK facilitator's verdict on each payment
//   node batch-vectors.mjs chaintest OUT.json     writes what the SDK signs and calls for one channel on
//                                                 chaintest's simulated chain
//
// sign and verify are run by e2e/batch_interop_test.go (TestBatchSettlementSignaturesInteroperateWithTheTypeScriptSDK)
// with fresh keys: what the SDK signs, Go must verify, and what Go signs, the SDK's own facilitator verification
// must accept. chain/testdata/batch-sdk-signed.json is a kept output of sign. Keys come on stdin, never in
// arguments (they would show in `ps`).
//
// sign's spec: {network, asset, payTo, receiverAuthorizer, withdrawDelay, amount, tokenName, tokenVersion,
// payerKey, voucherKey, salt}. It prints {payments: [{name, payment}]}: an ERC-3009 deposit, a Permit2 deposit,
// vouchers signed by the payer and by a separate voucher key (payerAuthorizer), and a refund, each as the client
// puts it in PAYMENT-SIGNATURE, with the channel id the SDK computes for it.
//
// verify's items: [{name, payment, requirements, balance, totalClaimed}] or [{name, payment, requirements, rpc}].
// The facilitator reads the channel's balance and total claimed on chain. With rpc it reads the chain there (a
// dev chain: through its Multicall3, as on any network); else a stub chain answers balance and totalClaimed (and
// says every payer is an EOA, has the deposit's tokens and Permit2 allowance, and that the deposit would not
// revert), so the verdict is the SDK's checks of the signatures and of the channel's terms. It prints
// [{name, isValid, invalidReason}].
//
// chaintest is run by hand after `npm ci` here, when the SDK or chaintest's accounts change:
//   node batch-vectors.mjs chaintest ../../chain/chaintest/testdata/batch-settlement-sdk-vector.json
// It signs with chaintest's deterministic accounts and USDCoin what the SDK's client signs for an eip3009 deposit
// and a voucher and what its facilitator signs for a claim batch and a refund, and lists the selectors and event
// topics of the SDK's x402BatchSettlement ABI, so that chain/chaintest's tests check our contracts and signer
// against the SDK with no node in CI.
import fs from "node:fs";
import { createRequire } from "node:module";
import {
  BatchSettlementEvmScheme as Client,
  computeChannelId,
  createBatchSettlementEIP3009DepositPayload,
  signVoucher,
} from "@x402/evm/batch-settlement/client";
import { BatchSettlementEvmScheme as Facilitator } from "@x402/evm/batch-settlement/facilitator";
import {
  BATCH_SETTLEMENT_ADDRESS,
  BATCH_SETTLEMENT_DOMAIN,
  claimBatchTypes,
  refundTypes,
  toClientEvmSigner,
  toFacilitatorEvmSigner,
} from "@x402/evm";
import {
  createWalletClient,
  decodeFunctionData,
  defineChain,
  encodeFunctionResult,
  getContractAddress,
  http,
  keccak256,
  parseAbi,
  publicActions,
  toBytes,
  toEventSelector,
  toEventSignature,
  toFunctionSelector,
  toFunctionSignature,
} from "viem";
import { generatePrivateKey, privateKeyToAccount } from "viem/accounts";

async function readStdin() {
  const chunks = [];
  for await (const c of process.stdin) chunks.push(c);
  return JSON.parse(Buffer.concat(chunks).toString("utf8"));
}

function requirements(spec, method) {
  return {
    scheme: "batch-settlement",
    network: spec.network,
    amount: spec.amount,
    asset: spec.asset,
    payTo: spec.payTo,
    maxTimeoutSeconds: 300,
    extra: {
      name: spec.tokenName,
      version: spec.tokenVersion,
      ...(method ? { assetTransferMethod: method } : {}),
      receiverAuthorizer: spec.receiverAuthorizer,
      withdrawDelay: spec.withdrawDelay,
      minDeposit: (BigInt(spec.amount) * 10n).toString(),
    },
  };
}

async function sign(spec) {
  const payer = toClientEvmSigner(privateKeyToAccount(spec.payerKey));
  const voucherSigner = toClientEvmSigner(privateKeyToAccount(spec.voucherKey));
  const out = [];
  const add = (name, accepted, result) =>
    out.push({ name, payment: { x402Version: 2, accepted, payload: result.payload, ...(result.extensions ? { extensions: result.extensions } : {}) } });

  const rq3009 = requirements(spec);
  add("deposit-eip3009", rq3009, await new Client(payer, { salt: spec.salt }).createPaymentPayload(2, rq3009));
  const rqPermit2 = requirements(spec, "permit2");
  add("deposit-permit2", rqPermit2, await new Client(payer, { salt: spec.salt }).createPaymentPayload(2, rqPermit2));

  // Vouchers as the client sends them once the channel holds a deposit: the payer's own, and one signed by a
  // separate voucher key the channel names as payerAuthorizer.
  for (const [name, opts] of [["voucher-payer", { salt: spec.salt }], ["voucher-authorizer", { salt: spec.salt, voucherSigner }]]) {
    const client = new Client(payer, opts);
    const config = client.buildChannelConfig(rq3009);
    const channelId = computeChannelId(config, spec.network);
    const cumulative = (BigInt(spec.amount) * 3n).toString();
    const voucher = await signVoucher(opts.voucherSigner ?? payer, channelId, cumulative, spec.network);
    add(name, rq3009, { payload: { type: "voucher", channelConfig: config, voucher } });
  }
  {
    const client = new Client(payer, { salt: spec.salt });
    const config = client.buildChannelConfig(rq3009);
    const channelId = computeChannelId(config, spec.network);
    const voucher = await signVoucher(payer, channelId, (BigInt(spec.amount) * 3n).toString(), spec.network);
    add("refund", rq3009, { payload: { type: "refund", channelConfig: config, voucher, amount: spec.amount } });
  }
  for (const p of out) {
    p.channelId = p.payment.payload.voucher.channelId;
  }
  return { payments: out };
}

// stubChain answers the facilitator's reads: every address an EOA, the channel's balance and total claimed as
// given, no withdrawal pending, refund nonce 0, the payer rich and Permit2 approved, the deposit not reverting.
function stubChain(balance, totalClaimed) {
  const views = parseAbi([
    "function channels(bytes32) view returns (uint128 balance, uint128 totalClaimed)",
    "function pendingWithdrawals(bytes32) view returns (uint128 amount, uint40 initiatedAt)",
    "function refundNonce(bytes32) view returns (uint256)",
    "function balanceOf(address) view returns (uint256)",
  ]);
  const answer = callData => {
    const { functionName } = decodeFunctionData({ abi: views, data: callData });
    const result = {
      channels: [BigInt(balance), BigInt(totalClaimed)],
      pendingWithdrawals: [0n, 0],
      refundNonce: 0n,
      balanceOf: 10n ** 30n,
    }[functionName];
    return encodeFunctionResult({ abi: views, functionName, result });
  };
  return {
    getAddresses: () => ["0x0000000000000000000000000000000000000001"],
    getCode: async () => "0x",
    readContract: async ({ functionName, args }) => {
      switch (functionName) {
        case "tryAggregate":
          return args[1].map(call => ({ success: true, returnData: answer(call.callData) }));
        case "allowance":
          return 10n ** 30n;
        case "deposit":
          return undefined;
      }
      throw new Error(`stub chain: unexpected read ${functionName}`);
    },
    verifyTypedData: async () => {
      throw new Error("stub chain: verifyTypedData is not expected");
    },
  };
}

// chainSigner is the facilitator's view of a real chain at rpcUrl (a throwaway key: verify sends nothing), where
// its reads go through Multicall3 as on any network.
function chainSigner(rpcUrl, network) {
  const chain = defineChain({
    id: Number(network.split(":")[1]),
    name: "x402 dev chain",
    nativeCurrency: { name: "Ether", symbol: "ETH", decimals: 18 },
    rpcUrls: { default: { http: [rpcUrl] } },
  });
  const account = privateKeyToAccount(generatePrivateKey());
  const client = createWalletClient({ account, chain, transport: http(rpcUrl) }).extend(publicActions);
  return toFacilitatorEvmSigner({ ...client, address: account.address });
}

async function verify(items) {
  const out = [];
  for (const it of items) {
    const facilitator = new Facilitator(it.rpc ? chainSigner(it.rpc, it.requirements.network) : stubChain(it.balance, it.totalClaimed));
    try {
      const r = await facilitator.verify(it.payment, it.requirements);
      out.push({ name: it.name, isValid: r.isValid, invalidReason: r.invalidReason ?? "" });
    } catch (e) {
      out.push({ name: it.name, isValid: false, invalidReason: `threw: ${e instanceof Error ? e.message : String(e)}` });
    }
  }
  return out;
}

// chaintestVector writes to out what the SDK signs and calls for one channel on chaintest's simulated chain.
async function chaintestVector(out) {
  // chaintest.DeriveAccount(label, i): key = keccak256("caddy-x402 chaintest/" + label + "/" + i).
  const account = (label, i) => privateKeyToAccount(keccak256(toBytes(`caddy-x402 chaintest/${label}/${i}`)));
  const chainId = 72344;
  const network = `eip155:${chainId}`;
  const payer = account("payer", 0);
  const authorizer = account("authorizer", 0);
  const receiver = account("merchant", 0).address;
  // chaintest.New deploys the StableCoin and mints to five payers (nonces 0-5); DeployUSDCoin comes next.
  const token = getContractAddress({ from: account("deployer", 0).address, nonce: 6n });

  const channelConfig = {
    payer: payer.address,
    payerAuthorizer: payer.address,
    receiver,
    receiverAuthorizer: authorizer.address,
    token,
    withdrawDelay: 900,
    salt: "0x" + "00".repeat(31) + "01",
  };
  const requirements = {
    scheme: "batch-settlement",
    network,
    asset: token,
    amount: "1000",
    payTo: receiver,
    // Ten years, so the deposit authorization's validBefore outlives the vector.
    maxTimeoutSeconds: 315_360_000,
    extra: { name: "USD Coin", version: "2", receiverAuthorizer: authorizer.address, withdrawDelay: 900 },
  };
  const channelId = computeChannelId(channelConfig, network);
  const deposit = await createBatchSettlementEIP3009DepositPayload(payer, 2, requirements, channelConfig, "1000000", "1000");
  const voucher = await signVoucher(payer, channelId, "250000", network);
  const domain = { ...BATCH_SETTLEMENT_DOMAIN, chainId, verifyingContract: BATCH_SETTLEMENT_ADDRESS };
  const claimAuthorizerSignature = await authorizer.signTypedData({
    domain, types: claimBatchTypes, primaryType: "ClaimBatch",
    message: { claims: [{ channelId, maxClaimableAmount: 250000n, totalClaimed: 250000n }] },
  });
  const refundAuthorizerSignature = await authorizer.signTypedData({
    domain, types: refundTypes, primaryType: "Refund", message: { channelId, nonce: 0n, amount: 750000n },
  });

  // The SDK"s x402BatchSettlement ABI is not exported: read it from the package's own TypeScript source map.
  const require = createRequire(import.meta.url);
  const map = JSON.parse(fs.readFileSync(require.resolve("@x402/evm/batch-settlement/facilitator").replace(/\.js$/, ".js.map"), "utf8"));
  const abiSource = map.sourcesContent[map.sources.findIndex(s => s.endsWith("batch-settlement/abi.ts"))];
  const abi = new Function(abiSource.replace(/ as const/g, "").replace(/export /g, "") + "\nreturn batchSettlementABI;")();
  const selectors = abi.map(item => item.type === "event"
    ? { signature: toEventSignature(item), id: toEventSelector(item) }
    : { signature: toFunctionSignature(item), id: toFunctionSelector(item) });

  fs.writeFileSync(out, JSON.stringify({
    sdk: "@x402/evm 2.27.0",
    chainId, network, token, channelConfig, channelId,
    deposit: deposit.payload,
    voucher,
    claimAuthorizerSignature,
    refund: { nonce: "0", amount: "750000", signature: refundAuthorizerSignature },
    abi: selectors,
  }, null, 2) + "\n");
}

const mode = process.argv[2];
if (mode === "sign") {
  process.stdout.write(JSON.stringify(await sign(await readStdin())) + "\n");
} else if (mode === "verify") {
  process.stdout.write(JSON.stringify(await verify(await readStdin())) + "\n");
} else if (mode === "chaintest" && process.argv[3]) {
  await chaintestVector(process.argv[3]);
} else {
  process.stderr.write("usage: node batch-vectors.mjs sign|verify < input.json, or node batch-vectors.mjs chaintest OUT.json\n");
  process.exit(2);
}
