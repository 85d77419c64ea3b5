// Compiles the contracts of this folder with the pinned solc-js and writes, per contract,
// build/<Name>.abi.json, build/<Name>.bin (creation code) and build/<Name>.bin-runtime.
// Run through `go generate ./chain/contracts`; the outputs are committed. An optional first
// argument names another output folder (the Go test uses it to check reproducibility).
'use strict';

const fs = require('fs');
const path = require('path');
const solc = require('solc');

const here = __dirname;
const outDir = path.resolve(process.argv[2] || path.join(here, 'build'));

// Contracts whose runtime code goes into a genesis: they must not use immutables.
const genesisContracts = new Set([
  'Permit2',
  'X402ExactPermit2Proxy',
  'X402UptoPermit2Proxy',
  'X402BatchSettlement',
  'ERC3009DepositCollector',
  'Permit2DepositCollector',
  'Multicall3',
]);
// Each contract and the source file it is in.
const contracts = {
  StableCoin: 'StableCoin.sol',
  USDCoin: 'USDCoin.sol',
  Permit2: 'Permit2.sol',
  X402ExactPermit2Proxy: 'X402ExactPermit2Proxy.sol',
  X402UptoPermit2Proxy: 'X402UptoPermit2Proxy.sol',
  X402BatchSettlement: 'X402BatchSettlement.sol',
  ERC3009DepositCollector: 'ERC3009DepositCollector.sol',
  Permit2DepositCollector: 'Permit2DepositCollector.sol',
  Multicall3: 'Multicall3.sol',
  SmartWallet: 'SmartWallet.sol',
  SmartWalletFactory: 'SmartWallet.sol',
  DeployThenCall: 'DeployThenCall.sol',
  SimulationOnlyWallet: 'SimulationOnlyWallet.sol',
};

const sources = {};
for (const file of new Set(Object.values(contracts))) {
  sources[file] = { content: fs.readFileSync(path.join(here, file), 'utf8') };
}

const input = {
  language: 'Solidity',
  sources,
  settings: {
    optimizer: { enabled: true, runs: 200 },
    evmVersion: 'cancun',
    // No metadata hash: the bytecode then changes only when the code does, not its comments.
    metadata: { bytecodeHash: 'none' },
    outputSelection: {
      '*': { '*': ['abi', 'evm.bytecode.object', 'evm.deployedBytecode.object', 'evm.deployedBytecode.immutableReferences'] },
    },
  },
};

function findImports(importPath) {
  const candidates = [path.join(here, 'node_modules', importPath), path.join(here, importPath)];
  for (const file of candidates) {
    if (fs.existsSync(file)) {
      return { contents: fs.readFileSync(file, 'utf8') };
    }
  }
  return { error: `import ${importPath} not found (did npm ci run?)` };
}

const output = JSON.parse(solc.compile(JSON.stringify(input), { import: findImports }));
let failed = false;
for (const msg of output.errors || []) {
  // OpenZeppelin's transient reentrancy guard is the documented safe use of tstore.
  if (msg.severity === 'warning' && msg.sourceLocation && msg.sourceLocation.file.startsWith('@openzeppelin/')) continue;
  process.stderr.write(msg.formattedMessage + '\n');
  if (msg.severity === 'error') failed = true;
}
if (failed) process.exit(1);

fs.mkdirSync(outDir, { recursive: true });
for (const [name, file] of Object.entries(contracts)) {
  const c = output.contracts[file][name];
  if (!c) {
    process.stderr.write(`contract ${name} missing from compiler output\n`);
    process.exit(1);
  }
  const immutables = Object.keys(c.evm.deployedBytecode.immutableReferences || {});
  if (genesisContracts.has(name) && immutables.length > 0) {
    process.stderr.write(`${name} uses immutables and cannot be placed into a genesis\n`);
    process.exit(1);
  }
  fs.writeFileSync(path.join(outDir, `${name}.abi.json`), JSON.stringify(c.abi, null, 2) + '\n');
  fs.writeFileSync(path.join(outDir, `${name}.bin`), c.evm.bytecode.object + '\n');
  fs.writeFileSync(path.join(outDir, `${name}.bin-runtime`), c.evm.deployedBytecode.object + '\n');
}
process.stdout.write(`solc ${solc.version()}: wrote ${Object.keys(contracts).length} contracts to ${path.relative(process.cwd(), outDir) || '.'}\n`);
