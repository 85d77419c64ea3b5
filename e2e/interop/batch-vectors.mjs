// batch-vectors.mjs signs and verifies batch-settlement payments with the public TypeScript x402 SDK
// (@x402/evm's batch-settlement client and facilitator), for chain/batch_interop_test.go: what the SDK signs,
// Go must verify, and what Go signs, the SDK's own facilitator verification must accept.
//
//   node batch-vectors.mjs sign   < spec.json    prints the payments the SDK's client signs
//   node batch-vectors.mjs verify < items.json   prints the SDK facilitator's verdict on each payment
//
// Keys come on stdin, never in arguments (they would show in `ps`).
//
// sign's spec: {network, asset, payTo, receiverAuthorizer, withdrawDelay, amount, tokenName, tokenVersion,
// payerKey, voucherKey, salt}. It prints {payments: [{name, payment}]}: an ERC-3009 deposit, a Permit2 deposit,
// vouchers signed by the payer and by a separate voucher key (payerAuthorizer), and a refund, each as the client
// puts it in PAYMENT-SIGNATURE, with the channel id the SDK computes for it.
//
// verify's items: [{name, payment, requirements, balance, totalClaimed}]. The facilitator reads the channel's
// balance and total claimed on chain; here a stub chain answers them (and says every payer is an EOA, has the
// deposit's tokens and Permit2 allowance, and that the deposit would not revert), so the verdict is the SDK's
// checks of the signatures and of the channel's terms. It prints [{name, isValid, invalidReason}].
import { BatchSettlementEvmScheme as Client, computeChannelId, signVoucher } from "@x402/evm/batch-settlement/client";
import { BatchSettlementEvmScheme as Facilitator } from "@x402/evm/batch-settlement/facilitator";
import { toClientEvmSigner } from "@x402/evm";
import { decodeFunctionData, encodeFunctionResult, parseAbi } from "viem";
import { privateKeyToAccount } from "viem/accounts";

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

async function verify(items) {
  const out = [];
  for (const it of items) {
    const facilitator = new Facilitator(stubChain(it.balance, it.totalClaimed));
    try {
      const r = await facilitator.verify(it.payment, it.requirements);
      out.push({ name: it.name, isValid: r.isValid, invalidReason: r.invalidReason ?? "" });
    } catch (e) {
      out.push({ name: it.name, isValid: false, invalidReason: `threw: ${e instanceof Error ? e.message : String(e)}` });
    }
  }
  return out;
}

const mode = process.argv[2];
const input = await readStdin();
if (mode === "sign") {
  process.stdout.write(JSON.stringify(await sign(input)) + "\n");
} else if (mode === "verify") {
  process.stdout.write(JSON.stringify(await verify(input)) + "\n");
} else {
  process.stderr.write("usage: node batch-vectors.mjs sign|verify < input.json\n");
  process.exit(2);
}
