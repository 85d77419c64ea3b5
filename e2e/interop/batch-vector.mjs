// Writes chain/chaintest/testdata/batch-settlement-sdk-vector.json: what the public @x402/evm 2.27 client and
// facilitator sign and call for one batch-settlement channel on the simulated chain (chaintest's accounts and
// USDCoin), so that Go tests check our contracts and signer against the SDK without network or node in CI.
// Run by hand after `npm ci` here: node batch-vector.mjs ../../chain/chaintest/testdata/batch-settlement-sdk-vector.json
import fs from 'node:fs';
import { createRequire } from 'node:module';
import { getContractAddress, keccak256, toBytes, toFunctionSelector, toEventSelector, toFunctionSignature, toEventSignature } from 'viem';
import { privateKeyToAccount } from 'viem/accounts';
import { BATCH_SETTLEMENT_ADDRESS, BATCH_SETTLEMENT_DOMAIN, claimBatchTypes, refundTypes } from '@x402/evm';
import { computeChannelId, signVoucher, createBatchSettlementEIP3009DepositPayload } from '@x402/evm/batch-settlement/client';

const out = process.argv[2];
if (!out) throw new Error('usage: node batch-vector.mjs OUT.json');

// chaintest.DeriveAccount(label, i): key = keccak256("caddy-x402 chaintest/" + label + "/" + i).
const account = (label, i) => privateKeyToAccount(keccak256(toBytes(`caddy-x402 chaintest/${label}/${i}`)));
const chainId = 72344;
const network = `eip155:${chainId}`;
const payer = account('payer', 0);
const authorizer = account('authorizer', 0);
const receiver = account('merchant', 0).address;
// chaintest.New deploys the StableCoin and mints to five payers (nonces 0-5); DeployUSDCoin comes next.
const token = getContractAddress({ from: account('deployer', 0).address, nonce: 6n });

const channelConfig = {
  payer: payer.address,
  payerAuthorizer: payer.address,
  receiver,
  receiverAuthorizer: authorizer.address,
  token,
  withdrawDelay: 900,
  salt: '0x' + '00'.repeat(31) + '01',
};
const requirements = {
  scheme: 'batch-settlement',
  network,
  asset: token,
  amount: '1000',
  payTo: receiver,
  // Ten years, so the deposit authorization's validBefore outlives the vector.
  maxTimeoutSeconds: 315_360_000,
  extra: { name: 'USD Coin', version: '2', receiverAuthorizer: authorizer.address, withdrawDelay: 900 },
};
const channelId = computeChannelId(channelConfig, network);
const deposit = await createBatchSettlementEIP3009DepositPayload(payer, 2, requirements, channelConfig, '1000000', '1000');
const voucher = await signVoucher(payer, channelId, '250000', network);
const domain = { ...BATCH_SETTLEMENT_DOMAIN, chainId, verifyingContract: BATCH_SETTLEMENT_ADDRESS };
const claimAuthorizerSignature = await authorizer.signTypedData({
  domain, types: claimBatchTypes, primaryType: 'ClaimBatch',
  message: { claims: [{ channelId, maxClaimableAmount: 250000n, totalClaimed: 250000n }] },
});
const refundAuthorizerSignature = await authorizer.signTypedData({
  domain, types: refundTypes, primaryType: 'Refund', message: { channelId, nonce: 0n, amount: 750000n },
});

// The SDK's x402BatchSettlement ABI is not exported: read it from the package's own TypeScript source map.
const require = createRequire(import.meta.url);
const map = JSON.parse(fs.readFileSync(require.resolve('@x402/evm/batch-settlement/facilitator').replace(/\.js$/, '.js.map'), 'utf8'));
const abiSource = map.sourcesContent[map.sources.findIndex(s => s.endsWith('batch-settlement/abi.ts'))];
const abi = new Function(abiSource.replace(/ as const/g, '').replace(/export /g, '') + '\nreturn batchSettlementABI;')();
const selectors = abi.map(item => item.type === 'event'
  ? { signature: toEventSignature(item), id: toEventSelector(item) }
  : { signature: toFunctionSignature(item), id: toFunctionSelector(item) });

fs.writeFileSync(out, JSON.stringify({
  sdk: '@x402/evm 2.27.0',
  chainId, network, token, channelConfig, channelId,
  deposit: deposit.payload,
  voucher,
  claimAuthorizerSignature,
  refund: { nonce: '0', amount: '750000', signature: refundAuthorizerSignature },
  abi: selectors,
}, null, 2) + '\n');
