package devchain

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/ecdsa"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/crypto"
	"github.com/ethereum/go-ethereum/ethclient"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
)

func TestDevKeysAreDerivedFromTheDocumentedSeed(t *testing.T) {
	documented := func(role string, i int) common.Address {
		key, err := crypto.ToECDSA(crypto.Keccak256([]byte("caddy-x402 dev chain/" + role + "/" + strconv.Itoa(i))))
		if err != nil {
			t.Fatalf("seed of %s/%d is not a key: %v", role, i, err)
		}
		return crypto.PubkeyToAddress(key.PublicKey)
	}
	tests := []struct {
		name string
		key  *ecdsa.PrivateKey
		want common.Address
	}{
		{"deployer", deployerKey(), documented("deployer", 0)},
		{"payer", PayerKey(), documented("payer", 0)},
		{"second payer", PayerKeyN(1), documented("payer", 1)},
		{"wallet 0", walletKey(0), documented("wallet", 0)},
		{"wallet 3", WalletKeys(4)[3], documented("wallet", 3)},
	}
	for _, tt := range tests {
		if got := crypto.PubkeyToAddress(tt.key.PublicKey); got != tt.want {
			t.Errorf("%s: address %s, want %s", tt.name, got, tt.want)
		}
	}
	if got := crypto.PubkeyToAddress(deployerKey().PublicKey); got != deployerAddress {
		t.Errorf("deployerAddress is %s, the deployer key derives %s", deployerAddress, got)
	}
	if got := crypto.PubkeyToAddress(PayerKey().PublicKey); got != PayerAddress {
		t.Errorf("PayerAddress is %s, the payer key derives %s", PayerAddress, got)
	}
	if got := crypto.CreateAddress(deployerAddress, 0); got != TokenAddress {
		t.Errorf("TokenAddress is %s, the deployer's first contract lands at %s", TokenAddress, got)
	}
	seen := map[common.Address]bool{deployerAddress: true, PayerAddress: true}
	for i, key := range WalletKeys(8) {
		addr := crypto.PubkeyToAddress(key.PublicKey)
		if seen[addr] {
			t.Errorf("wallet %d repeats address %s", i, addr)
		}
		seen[addr] = true
	}
	if n := len(WalletKeys(-1)); n != 0 {
		t.Errorf("WalletKeys(-1) returned %d keys, want 0", n)
	}
}

func TestStartRejectsUnusableSettingsWithAnActionableError(t *testing.T) {
	dir := t.TempDir()
	malformed := filepath.Join(dir, "malformed.json")
	devWriteFile(t, malformed, `["not", "an", "alloc"]`)
	tokenClash := filepath.Join(dir, "clash.json")
	devWriteFile(t, tokenClash, `{"`+TokenAddress.Hex()+`": {"balance": "0x0", "code": "0x00"}}`)

	tests := []struct {
		name string
		cfg  Config
		want string
	}{
		{"fractional block time", Config{BlockTime: 1500 * time.Millisecond}, "whole seconds"},
		{"negative block time", Config{BlockTime: -time.Second}, "whole seconds"},
		{"listen without port", Config{Listen: "127.0.0.1"}, "host:port"},
		{"listen without host", Config{Listen: ":8545"}, "names no host"},
		{"listen port out of range", Config{Listen: "127.0.0.1:70000"}, "0 to 65535"},
		{"negative wallets", Config{Wallets: -1}, "must not be negative"},
		{"missing alloc file", Config{AllocFile: filepath.Join(dir, "absent.json")}, "absent.json"},
		{"malformed alloc file", Config{AllocFile: malformed}, "genesis alloc object"},
		{"alloc code at the token address", Config{Listen: "127.0.0.1:0", AllocFile: tokenClash}, "leave that address out"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d, err := Start(context.Background(), tt.cfg)
			if err == nil {
				d.Close()
				t.Fatalf("started, want an error mentioning %q", tt.want)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %q, want it to mention %q", err, tt.want)
			}
		})
	}
}

func TestDevChainServesTheX402ContractsAndFundedAccountsOverHTTP(t *testing.T) {
	obs, logs := observer.New(zapcore.InfoLevel)
	start := time.Now()
	d := devStart(t, Config{Listen: "127.0.0.1:0", Logger: zap.New(obs)})
	t.Logf("dev chain started in %s", time.Since(start))
	ctx := devContext(t)
	client := devDial(t, d)

	if port := devPortOf(t, d.RPCURL()); port == 0 {
		t.Errorf("RPCURL %s reports port 0, want the port actually bound", d.RPCURL())
	}
	id, err := client.ChainID(ctx)
	if err != nil || id.Uint64() != DefaultChainID || d.ChainID() != DefaultChainID {
		t.Errorf("chain id over HTTP %v (%v), ChainID() %d, want %d", id, err, d.ChainID(), DefaultChainID)
	}
	if d.Network() != "eip155:72344" {
		t.Errorf("Network() %q, want eip155:72344", d.Network())
	}
	for _, c := range []struct {
		name string
		addr common.Address
		want []byte
	}{
		{"Permit2", contracts.Permit2Address, contracts.Permit2RuntimeCode()},
		{"proxy", contracts.ProxyAddress, contracts.ProxyRuntimeCode()},
		{"upto proxy", contracts.UptoProxyAddress, contracts.UptoProxyRuntimeCode()},
		{"batch settlement", contracts.BatchSettlementAddress, contracts.BatchSettlementRuntimeCode()},
		{"ERC-3009 deposit collector", contracts.ERC3009DepositCollectorAddress, contracts.ERC3009DepositCollectorRuntimeCode()},
		{"Permit2 deposit collector", contracts.Permit2DepositCollectorAddress, contracts.Permit2DepositCollectorRuntimeCode()},
		{"Multicall3", contracts.Multicall3Address, contracts.Multicall3RuntimeCode()},
	} {
		code, err := client.CodeAt(ctx, c.addr, nil)
		if err != nil || !bytes.Equal(code, c.want) {
			t.Errorf("%s at %s: %d bytes of code (%v), want its %d bytes of runtime code", c.name, c.addr, len(code), err, len(c.want))
		}
	}
	if d.Token() != TokenAddress {
		t.Errorf("Token() %s, want %s", d.Token(), TokenAddress)
	}
	if code, err := client.CodeAt(ctx, TokenAddress, nil); err != nil || len(code) == 0 {
		t.Errorf("no token code at %s (%v)", TokenAddress, err)
	}
	if name := devCallToken[string](t, client, "name"); name != contracts.StableCoinName {
		t.Errorf("token name %q, want %q", name, contracts.StableCoinName)
	}
	if decimals := devCallToken[uint8](t, client, "decimals"); decimals != contracts.StableCoinDecimals {
		t.Errorf("token decimals %d, want %d", decimals, contracts.StableCoinDecimals)
	}
	payer := crypto.PubkeyToAddress(d.Payer().PublicKey)
	if payer != PayerAddress {
		t.Errorf("Payer() is %s, want %s", payer, PayerAddress)
	}
	if bal := devCallToken[*big.Int](t, client, "balanceOf", payer); bal.Cmp(big.NewInt(mintPerPayer)) != 0 {
		t.Errorf("payer holds %s raw tokens, want %d", bal, int64(mintPerPayer))
	}
	// The USDC-like token, from its own deployer, at its documented address, held by the payer too.
	if d.EIP3009Token() != EIP3009TokenAddress || crypto.CreateAddress(eip3009DeployerAddress, 0) != EIP3009TokenAddress ||
		crypto.PubkeyToAddress(eip3009DeployerKey().PublicKey) != eip3009DeployerAddress {
		t.Errorf("EIP3009Token() %s, want %s = CreateAddress(%s, 0)", d.EIP3009Token(), EIP3009TokenAddress, eip3009DeployerAddress)
	}
	if name := devCallTokenAt[string](t, client, EIP3009TokenAddress, "name"); name != contracts.USDCoinName {
		t.Errorf("EIP-3009 token name %q, want %q", name, contracts.USDCoinName)
	}
	if bal := devCallTokenAt[*big.Int](t, client, EIP3009TokenAddress, "balanceOf", payer); bal.Cmp(big.NewInt(mintPerPayer)) != 0 {
		t.Errorf("payer holds %s raw units of the EIP-3009 token, want %d", bal, int64(mintPerPayer))
	}
	if allowance := devCallToken[*big.Int](t, client, "allowance", payer, contracts.Permit2Address); allowance.Sign() != 0 {
		t.Errorf("payer's Permit2 allowance is %s, want 0 (gas sponsoring grants it)", allowance)
	}
	funded := append([]*ecdsa.PrivateKey{d.Payer()}, d.WalletKeys()...)
	if len(funded) != 1+DefaultWallets {
		t.Errorf("%d wallets, want %d", len(funded)-1, DefaultWallets)
	}
	for _, key := range funded {
		addr := crypto.PubkeyToAddress(key.PublicKey)
		if bal, err := client.BalanceAt(ctx, addr, nil); err != nil || bal.Cmp(accountBalance()) != 0 {
			t.Errorf("%s holds %v wei (%v), want %s", addr, bal, err, accountBalance())
		}
	}

	report := logs.FilterMessageSnippet("DEV CHAIN ONLY").All()
	if len(report) != 1 {
		t.Fatalf("%d log entries carry the dev-only warning, want 1 (for the one payer)", len(report))
	}
	fields := report[0].ContextMap()
	if fields["address"] != PayerAddress.Hex() || fields["private_key"] != "0x"+common.Bytes2Hex(crypto.FromECDSA(PayerKey())) {
		t.Errorf("payer log fields %v, want the payer's address and private key", fields)
	}
	started := logs.FilterMessage("dev chain started").All()
	if len(started) != 1 || started[0].ContextMap()["rpc"] != d.RPCURL() || started[0].ContextMap()["token"] != TokenAddress.Hex() ||
		started[0].ContextMap()["eip3009_token"] != EIP3009TokenAddress.Hex() {
		t.Errorf("startup log %v, want the RPC URL %s, token %s and eip3009_token %s", started, d.RPCURL(), TokenAddress, EIP3009TokenAddress)
	}
}

func TestDevChainSealsATransferAtOnceAtLiveNetworkGasCost(t *testing.T) {
	d := devStart(t, Config{Listen: "127.0.0.1:0"})
	client := devDial(t, d)
	ctx := devContext(t)

	sent := time.Now()
	tx := devSendTransfer(t, client, d.Payer(), common.HexToAddress("0xbeef"), big.NewInt(1_000_000), 0)
	receipt := devWaitMined(t, client, tx.Hash())
	if waited := time.Since(sent); waited > time.Second {
		t.Errorf("transfer mined after %s, want within 1s with block time 0", waited)
	}
	if receipt.Status != types.ReceiptStatusSuccessful {
		t.Fatalf("transfer reverted")
	}
	// An ERC-20 transfer to a fresh holder costs about 35k-52k gas on live forks; the unreleased forks of
	// go-ethereum's dev set would charge about three times that.
	if receipt.GasUsed < 35_000 || receipt.GasUsed > 52_000 {
		t.Errorf("transfer used %d gas, want 35,000-52,000", receipt.GasUsed)
	}
	got := devCallToken[*big.Int](t, client, "balanceOf", common.HexToAddress("0xbeef"))
	if got.Int64() != 1_000_000 {
		t.Errorf("recipient holds %s, want 1000000", got)
	}
	// The chain keeps no log index; eth_getLogs must still find the transfer by scanning.
	logs, err := client.FilterLogs(ctx, ethereum.FilterQuery{
		FromBlock: big.NewInt(0),
		Addresses: []common.Address{TokenAddress},
		Topics:    [][]common.Hash{{contracts.StableCoinABI.Events["Transfer"].ID}, {common.BytesToHash(PayerAddress.Bytes())}},
	})
	if err != nil {
		t.Fatalf("eth_getLogs: %v", err)
	}
	if len(logs) != 1 || logs[0].TxHash != tx.Hash() {
		t.Errorf("eth_getLogs found %d Transfer logs from the payer, want the one of %s", len(logs), tx.Hash())
	}
}

func BenchmarkStart(b *testing.B) {
	for _, bc := range []struct {
		name string
		cfg  Config
	}{
		{"memory", Config{Listen: "127.0.0.1:0"}},
		{"memory block_time 1s", Config{Listen: "127.0.0.1:0", BlockTime: time.Second}},
		{"fresh data dir", Config{Listen: "127.0.0.1:0", DataDir: "fresh"}},
		{"data dir restart", Config{Listen: "127.0.0.1:0", DataDir: "restart"}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			root := b.TempDir()
			if bc.cfg.DataDir == "restart" {
				bc.cfg.DataDir = filepath.Join(root, "restart")
				d, err := Start(context.Background(), bc.cfg)
				if err != nil {
					b.Fatal(err)
				}
				d.Close()
			}
			for i := 0; b.Loop(); i++ {
				cfg := bc.cfg
				if cfg.DataDir == "fresh" {
					cfg.DataDir = filepath.Join(root, strconv.Itoa(i))
				}
				d, err := Start(context.Background(), cfg)
				if err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				d.Close()
				b.StartTimer()
			}
		})
	}
}

// BenchmarkDevChainSealsATransferPerBlock measures sealing one token transfer per block, sent and waited for
// one at a time: in memory (a scratch directory) and on a data dir, which writes every block through.
func BenchmarkDevChainSealsATransferPerBlock(b *testing.B) {
	for _, bc := range []struct {
		name    string
		dataDir bool
	}{{"memory", false}, {"data dir", true}} {
		b.Run(bc.name, func(b *testing.B) {
			cfg := Config{Listen: "127.0.0.1:0"}
			if bc.dataDir {
				cfg.DataDir = b.TempDir()
			}
			ctx := context.Background()
			d, err := Start(ctx, cfg)
			if err != nil {
				b.Fatal(err)
			}
			defer d.Close()
			client := d.Client()
			nonce, err := client.PendingNonceAt(ctx, PayerAddress)
			if err != nil {
				b.Fatal(err)
			}
			chainID := new(big.Int).SetUint64(d.ChainID())
			signer := types.LatestSignerForChainID(chainID)
			data, err := contracts.StableCoinABI.Pack("transfer", common.HexToAddress("0xbeef"), big.NewInt(1))
			if err != nil {
				b.Fatal(err)
			}
			tip := big.NewInt(1e9)
			first := devBlockNumberB(b, client)
			for b.Loop() {
				// The fee cap covers any base fee a chain of single-transfer blocks reaches.
				tx, err := types.SignNewTx(d.Payer(), signer, &types.DynamicFeeTx{ChainID: chainID, Nonce: nonce,
					GasTipCap: tip, GasFeeCap: big.NewInt(100e9), Gas: 100_000, To: &TokenAddress, Data: data})
				if err != nil {
					b.Fatal(err)
				}
				if err := client.SendTransaction(ctx, tx); err != nil {
					b.Fatal(err)
				}
				nonce++
				for {
					if _, err := client.TransactionReceipt(ctx, tx.Hash()); err == nil {
						break
					} else if !errors.Is(err, ethereum.NotFound) && !strings.Contains(err.Error(), errTxIndexing) {
						b.Fatal(err)
					}
					time.Sleep(200 * time.Microsecond)
				}
			}
			blocks := devBlockNumberB(b, client) - first
			b.ReportMetric(float64(blocks)/b.Elapsed().Seconds(), "blocks/s")
		})
	}
}

func devBlockNumberB(b *testing.B, client *ethclient.Client) uint64 {
	b.Helper()
	n, err := client.BlockNumber(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	return n
}

func TestDevChainWithABlockTimePacksTransactionsIntoOneBlockOnWallClockTime(t *testing.T) {
	d := devStart(t, Config{Listen: "127.0.0.1:0", BlockTime: time.Second})
	client := devDial(t, d)
	ctx := devContext(t)

	nonce, err := client.PendingNonceAt(ctx, PayerAddress)
	if err != nil {
		t.Fatal(err)
	}
	// Wait for a fresh block so that all transfers land in the same period.
	devWaitNextBlock(t, client)
	var txs []*types.Transaction
	for i := range 6 {
		txs = append(txs, devSendTransfer(t, client, d.Payer(), common.BigToAddress(big.NewInt(int64(0x1000+i))), big.NewInt(1), nonce+uint64(i)))
	}
	blocks := map[uint64]bool{}
	for _, tx := range txs {
		blocks[devWaitMined(t, client, tx.Hash()).BlockNumber.Uint64()] = true
	}
	if len(blocks) != 1 {
		t.Errorf("%d transfers sent together landed in %d blocks, want 1", len(txs), len(blocks))
	}
	head, err := client.HeaderByNumber(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if drift := time.Since(time.Unix(int64(head.Time), 0)); drift < -2*time.Second || drift > 2*time.Second {
		t.Errorf("head timestamp is %s off the wall clock, want within 2s", drift)
	}
}

func TestDevChainOnADataDirKeepsItsStateAcrossRestartsWithoutRedeploying(t *testing.T) {
	dir := t.TempDir()
	recipient := common.HexToAddress("0xcafe")
	cfg := Config{Listen: "127.0.0.1:0", DataDir: dir}

	first, err := Start(devContext(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	client := first.Client()
	devWaitMined(t, client, devSendTransfer(t, client, first.Payer(), recipient, big.NewInt(1234), 0).Hash())
	head := devBlockNumber(t, client)
	if err := first.Close(); err != nil {
		t.Fatalf("closing: %v", err)
	}

	obs, logs := observer.New(zapcore.InfoLevel)
	cfg.Logger = zap.New(obs)
	second := devStart(t, cfg)
	client = second.Client()
	if got := devBlockNumber(t, client); got < head {
		t.Errorf("restarted at block %d, want at least %d", got, head)
	}
	if got := devCallToken[*big.Int](t, client, "balanceOf", recipient); got.Int64() != 1234 {
		t.Errorf("recipient holds %s after restart, want 1234", got)
	}
	if got := devCallToken[*big.Int](t, client, "balanceOf", PayerAddress); got.Int64() != mintPerPayer-1234 {
		t.Errorf("payer holds %s after restart, want %d", got, int64(mintPerPayer-1234))
	}
	// Deployment, one mint and the USDCoin deployer's gas money; the USDCoin's deployment and one mint: a
	// redeployment, second mint or second funding would move a nonce on.
	devCheckSetupNonces(t, client)
	if entries := logs.FilterMessage("dev chain started").All(); len(entries) != 1 || entries[0].ContextMap()["token_deployed_now"] != false ||
		entries[0].ContextMap()["eip3009_token_deployed_now"] != false {
		t.Errorf("startup log %v, want token_deployed_now=false and eip3009_token_deployed_now=false", entries)
	}
	second.Close()

	cfg.ChainID = 723487
	if d, err := Start(devContext(t), cfg); err == nil {
		d.Close()
		t.Errorf("restart with another chain id started, want an error naming the changed genesis")
	} else if !strings.Contains(err.Error(), "another genesis") {
		t.Errorf("restart with another chain id: %v, want it to say the genesis changed", err)
	}
}

// testdata/before-usdcoin.tar.gz is the data dir of a default dev chain (one payer, four wallets)
// made by the version before the USDCoin (commit 20103ef), with no node key, locks or logs.
func TestDevChainOnADataDirFromBeforeTheUSDCoinOpensAndGetsTheUSDCoinOnce(t *testing.T) {
	dir := t.TempDir()
	devUntar(t, filepath.Join("testdata", "before-usdcoin.tar.gz"), dir)
	obs, logs := observer.New(zapcore.InfoLevel)
	cfg := Config{Listen: "127.0.0.1:0", DataDir: dir, Logger: zap.New(obs)}

	d := devStart(t, cfg)
	client := d.Client()
	if code, err := client.CodeAt(devContext(t), EIP3009TokenAddress, nil); err != nil || len(code) == 0 {
		t.Fatalf("no USDCoin at %s on the earlier data dir (%v)", EIP3009TokenAddress, err)
	}
	for _, token := range []common.Address{TokenAddress, EIP3009TokenAddress} {
		if bal := devCallTokenAt[*big.Int](t, client, token, "balanceOf", PayerAddress); bal.Cmp(big.NewInt(mintPerPayer)) != 0 {
			t.Errorf("payer holds %s raw units of %s, want %d", bal, token, int64(mintPerPayer))
		}
	}
	devCheckSetupNonces(t, client)
	if entries := logs.FilterMessage("dev chain started").All(); len(entries) != 1 || entries[0].ContextMap()["token_deployed_now"] != false ||
		entries[0].ContextMap()["eip3009_token_deployed_now"] != true || entries[0].ContextMap()["upto_proxy_in_genesis"] != false {
		t.Errorf("startup log %v, want token_deployed_now=false, eip3009_token_deployed_now=true and upto_proxy_in_genesis=false", entries)
	}
	// Its genesis predates the upto proxy, which only a genesis can place at its canonical address: the chain
	// opens without it, and says so.
	if code, err := client.CodeAt(devContext(t), contracts.UptoProxyAddress, nil); err != nil || len(code) != 0 {
		t.Errorf("code at the upto proxy address on a data dir from before it: %d bytes (%v), want none", len(code), err)
	}
	if n := logs.FilterMessageSnippet("created before the x402 upto proxy").Len(); n != 1 {
		t.Errorf("%d warnings that the data dir predates the upto proxy, want 1", n)
	}
	if code, err := client.CodeAt(devContext(t), contracts.BatchSettlementAddress, nil); err != nil || len(code) != 0 {
		t.Errorf("code at the batch settlement address on a data dir from before it: %d bytes (%v), want none", len(code), err)
	}
	if err := d.Close(); err != nil {
		t.Fatalf("closing: %v", err)
	}

	cfg.Logger = nil
	client = devStart(t, cfg).Client()
	devCheckSetupNonces(t, client)
}

// The testdata data dirs were made by a default dev chain of the version before some contracts were part of the
// genesis, with no node key, locks or logs: before-batch-settlement.tar.gz by commit 174668c (with the upto proxy),
// before-multicall3.tar.gz by commit f97ad2b (with the first batch-settlement escrow). Each opens on its own genesis,
// says what cannot work there, and keeps its state.
func TestDevChainOnADataDirFromAnEarlierGenesisOpens(t *testing.T) {
	for _, tc := range []struct {
		name, tarball string
		has           common.Address // a contract the earlier genesis had
		hasCode       []byte
		lacks         common.Address // the first one it lacks
		warning       string
		inGenesis     map[string]bool // startup log fields
	}{
		{"before the batch-settlement contracts", "before-batch-settlement.tar.gz",
			contracts.UptoProxyAddress, contracts.UptoProxyRuntimeCode(), contracts.BatchSettlementAddress,
			"created before the x402 batch-settlement contracts",
			map[string]bool{"upto_proxy_in_genesis": true, "batch_settlement_in_genesis": false, "multicall3_in_genesis": false}},
		{"before Multicall3", "before-multicall3.tar.gz",
			contracts.BatchSettlementAddress, common.FromHex(strings.TrimSpace(firstBatchEscrowRuntimeHex)), contracts.Multicall3Address,
			"created before Multicall3",
			map[string]bool{"upto_proxy_in_genesis": true, "batch_settlement_in_genesis": true, "multicall3_in_genesis": false}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			devUntar(t, filepath.Join("testdata", tc.tarball), dir)

			obs, logs := observer.New(zapcore.InfoLevel)
			d := devStart(t, Config{Listen: "127.0.0.1:0", DataDir: dir, Logger: zap.New(obs)})
			client := d.Client()
			if code, err := client.CodeAt(devContext(t), tc.has, nil); err != nil || !bytes.Equal(code, tc.hasCode) {
				t.Errorf("%s on the earlier data dir: %d bytes (%v), want its runtime code", tc.has, len(code), err)
			}
			if code, err := client.CodeAt(devContext(t), tc.lacks, nil); err != nil || len(code) != 0 {
				t.Errorf("%s on the earlier data dir: %d bytes (%v), want none", tc.lacks, len(code), err)
			}
			if bal := devCallTokenAt[*big.Int](t, client, TokenAddress, "balanceOf", PayerAddress); bal.Cmp(big.NewInt(mintPerPayer)) != 0 {
				t.Errorf("payer holds %s, want %d", bal, int64(mintPerPayer))
			}
			devCheckSetupNonces(t, client)
			if n := logs.FilterMessageSnippet(tc.warning).Len(); n != 1 {
				t.Errorf("%d warnings %q, want 1", n, tc.warning)
			}
			entries := logs.FilterMessage("dev chain started").All()
			if len(entries) != 1 {
				t.Fatalf("%d startup logs, want 1", len(entries))
			}
			for field, want := range tc.inGenesis {
				if got := entries[0].ContextMap()[field]; got != want {
					t.Errorf("startup log %s=%v, want %v", field, got, want)
				}
			}
		})
	}
}

// testdata/first-batch-escrow.tar.gz was made by a default dev chain of commit 2026706 (Multicall3 and the first
// batch-settlement escrow), with no node key, locks or logs: it opens on that genesis, with that escrow, and says so.
func TestDevChainOnADataDirWithTheFirstBatchEscrowOpens(t *testing.T) {
	dir := t.TempDir()
	devUntar(t, filepath.Join("testdata", "first-batch-escrow.tar.gz"), dir)
	obs, logs := observer.New(zapcore.InfoLevel)
	d := devStart(t, Config{Listen: "127.0.0.1:0", DataDir: dir, Logger: zap.New(obs)})
	client := d.Client()
	first := common.FromHex(strings.TrimSpace(firstBatchEscrowRuntimeHex))
	if bytes.Equal(first, contracts.BatchSettlementRuntimeCode()) {
		t.Fatal("the first escrow's code is today's")
	}
	if code, err := client.CodeAt(devContext(t), contracts.BatchSettlementAddress, nil); err != nil || !bytes.Equal(code, first) {
		t.Errorf("the escrow on the data dir: %d bytes (%v), want the first escrow's code", len(code), err)
	}
	if code, err := client.CodeAt(devContext(t), contracts.Multicall3Address, nil); err != nil || len(code) == 0 {
		t.Errorf("Multicall3 on the data dir: %d bytes (%v), want its code", len(code), err)
	}
	if bal := devCallTokenAt[*big.Int](t, client, TokenAddress, "balanceOf", PayerAddress); bal.Cmp(big.NewInt(mintPerPayer)) != 0 {
		t.Errorf("payer holds %s, want %d", bal, int64(mintPerPayer))
	}
	if n := logs.FilterMessageSnippet("created with the first x402 batch-settlement escrow").Len(); n != 1 {
		t.Errorf("%d warnings about the first escrow, want 1", n)
	}
	// A fresh data dir gets today's escrow.
	fresh := devStart(t, Config{Listen: "127.0.0.1:0", DataDir: t.TempDir()})
	if code, err := fresh.Client().CodeAt(devContext(t), contracts.BatchSettlementAddress, nil); err != nil || !bytes.Equal(code, contracts.BatchSettlementRuntimeCode()) {
		t.Errorf("the escrow on a fresh data dir: %d bytes (%v), want today's", len(code), err)
	}
}

func TestDevChainAppliesTheAllocFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "alloc.json")
	devWriteFile(t, path, `{
		"0x00000000000000000000000000000000000a110c": {
			"balance": "0x1234",
			"code": "0x60016001",
			"storage": {"0x0000000000000000000000000000000000000000000000000000000000000000": "0x000000000000000000000000000000000000000000000000000000000000002a"}
		}
	}`)
	d := devStart(t, Config{Listen: "127.0.0.1:0", AllocFile: path})
	client := devDial(t, d)
	ctx := devContext(t)
	addr := common.HexToAddress("0xa110c")

	if bal, err := client.BalanceAt(ctx, addr, nil); err != nil || bal.Int64() != 0x1234 {
		t.Errorf("balance %v (%v), want 0x1234", bal, err)
	}
	if code, err := client.CodeAt(ctx, addr, nil); err != nil || !bytes.Equal(code, []byte{0x60, 0x01, 0x60, 0x01}) {
		t.Errorf("code %x (%v), want 60016001", code, err)
	}
	if slot, err := client.StorageAt(ctx, addr, common.Hash{}, nil); err != nil || new(big.Int).SetBytes(slot).Int64() != 42 {
		t.Errorf("slot 0 holds %x (%v), want 42", slot, err)
	}
}

func TestTwoDevChainsRunSideBySideOnTheirOwnPorts(t *testing.T) {
	a := devStart(t, Config{Listen: "127.0.0.1:0"})
	b := devStart(t, Config{Listen: "127.0.0.1:0", ChainID: 723487, Wallets: 2, Payers: 2})
	if a.RPCURL() == b.RPCURL() {
		t.Fatalf("both chains serve %s", a.RPCURL())
	}
	ctx := devContext(t)
	for _, c := range []struct {
		d    *Chain
		want uint64
	}{{a, DefaultChainID}, {b, 723487}} {
		id, err := devDial(t, c.d).ChainID(ctx)
		if err != nil || id.Uint64() != c.want {
			t.Errorf("%s answers chain id %v (%v), want %d", c.d.RPCURL(), id, err, c.want)
		}
	}
	taken, err := Start(devContext(t), Config{Listen: devHostPort(t, a.RPCURL())})
	if err == nil {
		taken.Close()
		t.Errorf("a third chain started on %s, which the first holds", a.RPCURL())
	} else if !strings.Contains(err.Error(), "address already in use") {
		t.Errorf("starting on a taken port: %v, want it to say the address is in use", err)
	}
	if n := len(b.WalletKeys()); n != 2 {
		t.Errorf("%d wallets, want 2", n)
	}
	second := crypto.PubkeyToAddress(b.Payers()[1].PublicKey)
	if got := devCallToken[*big.Int](t, b.Client(), "balanceOf", second); got.Cmp(big.NewInt(mintPerPayer)) != 0 {
		t.Errorf("second payer holds %s raw tokens, want %d", got, int64(mintPerPayer))
	}
}

func TestClosingTheDevChainFreesItsPort(t *testing.T) {
	d, err := Start(devContext(t), Config{Listen: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	addr := devHostPort(t, d.RPCURL())
	if err := d.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	if err := d.Close(); err != nil {
		t.Errorf("second close: %v, want nil", err)
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("port %s still taken after Close: %v", addr, err)
	}
	l.Close()
}

// devStart starts a dev chain that closes when the test ends.
func devStart(t *testing.T, cfg Config) *Chain {
	t.Helper()
	d, err := Start(devContext(t), cfg)
	if err != nil {
		t.Fatalf("starting the dev chain: %v", err)
	}
	t.Cleanup(func() {
		if err := d.Close(); err != nil {
			t.Errorf("closing the dev chain: %v", err)
		}
	})
	return d
}

// devDial connects to the chain over HTTP, as another process would.
func devDial(t *testing.T, d *Chain) *ethclient.Client {
	t.Helper()
	client, err := ethclient.Dial(d.RPCURL())
	if err != nil {
		t.Fatalf("dialing %s: %v", d.RPCURL(), err)
	}
	t.Cleanup(client.Close)
	return client
}

func devContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// devCallToken calls a view of the dev token through client.
func devCallToken[T any](t *testing.T, client *ethclient.Client, method string, args ...any) T {
	t.Helper()
	return devCallTokenAt[T](t, client, TokenAddress, method, args...)
}

// devCallTokenAt calls an ERC-20 view of the token at addr.
func devCallTokenAt[T any](t *testing.T, client *ethclient.Client, token common.Address, method string, args ...any) T {
	t.Helper()
	data, err := contracts.StableCoinABI.Pack(method, args...)
	if err != nil {
		t.Fatalf("packing %s: %v", method, err)
	}
	out, err := client.CallContract(devContext(t), ethereum.CallMsg{To: &token, Data: data}, nil)
	if err != nil {
		t.Fatalf("calling %s: %v", method, err)
	}
	values, err := contracts.StableCoinABI.Unpack(method, out)
	if err != nil || len(values) != 1 {
		t.Fatalf("unpacking %s: %v (%d values)", method, err, len(values))
	}
	v, ok := values[0].(T)
	if !ok {
		t.Fatalf("%s returned %T, want %T", method, values[0], v)
	}
	return v
}

// devSendTransfer sends amount of the dev token from key to to; nonce 0 asks the chain for the next one.
func devSendTransfer(t *testing.T, client *ethclient.Client, key *ecdsa.PrivateKey, to common.Address, amount *big.Int, nonce uint64) *types.Transaction {
	t.Helper()
	ctx := devContext(t)
	from := crypto.PubkeyToAddress(key.PublicKey)
	if nonce == 0 {
		var err error
		if nonce, err = client.PendingNonceAt(ctx, from); err != nil {
			t.Fatal(err)
		}
	}
	head, err := client.HeaderByNumber(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	chainID, err := client.ChainID(ctx)
	if err != nil {
		t.Fatal(err)
	}
	data, err := contracts.StableCoinABI.Pack("transfer", to, amount)
	if err != nil {
		t.Fatal(err)
	}
	tip := big.NewInt(1e9)
	tx, err := types.SignNewTx(key, types.LatestSignerForChainID(chainID), &types.DynamicFeeTx{
		ChainID: chainID, Nonce: nonce, GasTipCap: tip, Gas: 100_000, To: &TokenAddress, Data: data,
		GasFeeCap: new(big.Int).Add(new(big.Int).Mul(head.BaseFee, big.NewInt(2)), tip),
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := client.SendTransaction(ctx, tx); err != nil {
		t.Fatalf("sending transfer: %v", err)
	}
	return tx
}

func devWaitMined(t *testing.T, client *ethclient.Client, hash common.Hash) *types.Receipt {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		receipt, err := client.TransactionReceipt(devContext(t), hash)
		if err == nil {
			return receipt
		}
		if !errors.Is(err, ethereum.NotFound) {
			t.Fatalf("receipt of %s: %v", hash, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("%s not mined within 10s", hash)
	return nil
}

func devWaitNextBlock(t *testing.T, client *ethclient.Client) {
	t.Helper()
	start := devBlockNumber(t, client)
	deadline := time.Now().Add(5 * time.Second)
	for devBlockNumber(t, client) == start {
		if time.Now().After(deadline) {
			t.Fatalf("no block after %d within 5s", start)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func devBlockNumber(t *testing.T, client *ethclient.Client) uint64 {
	t.Helper()
	n, err := client.BlockNumber(devContext(t))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func devHostPort(t *testing.T, rawURL string) string {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatalf("parsing %s: %v", rawURL, err)
	}
	return u.Host
}

func devPortOf(t *testing.T, rawURL string) int {
	t.Helper()
	_, port, err := net.SplitHostPort(devHostPort(t, rawURL))
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.Atoi(port)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func devWriteFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

// devCheckSetupNonces checks that a one-payer dev chain sent its setup transactions once: the StableCoin's
// deployer its deployment, its mint and the USDCoin deployer's gas money; the USDCoin's its deployment and mint.
func devCheckSetupNonces(t *testing.T, client *ethclient.Client) {
	t.Helper()
	for _, want := range []struct {
		who   string
		addr  common.Address
		nonce uint64
	}{{"StableCoin deployer", deployerAddress, 3}, {"USDCoin deployer", eip3009DeployerAddress, 2}} {
		if nonce, err := client.NonceAt(devContext(t), want.addr, nil); err != nil || nonce != want.nonce {
			t.Errorf("%s nonce %d (%v), want %d", want.who, nonce, err, want.nonce)
		}
	}
}

// devUntar unpacks the gzipped tar archive at path (plain files and folders) into dir.
func devUntar(t *testing.T, path, dir string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	gz, err := gzip.NewReader(f)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	archive := tar.NewReader(gz)
	for {
		h, err := archive.Next()
		if errors.Is(err, io.EOF) {
			return
		}
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		target := filepath.Join(dir, filepath.FromSlash(h.Name))
		switch h.Typeflag {
		case tar.TypeDir:
			err = os.MkdirAll(target, 0o755)
		case tar.TypeReg:
			var b []byte
			if b, err = io.ReadAll(archive); err == nil {
				err = os.WriteFile(target, b, 0o644)
			}
		default:
			err = fmt.Errorf("entry %s is neither a file nor a folder", h.Name)
		}
		if err != nil {
			t.Fatalf("unpacking %s: %v", path, err)
		}
	}
}

// StorageAt reads the head's state as eth_getStorageAt does over HTTP: the slots of the token (its balances
// mapping of the funded payer among them) and of Permit2, set or not.
func TestStorageAtReadsTheHeadStateAsTheRPCDoes(t *testing.T) {
	d := devStart(t, Config{Listen: "127.0.0.1:0"})
	ctx := devContext(t)
	client := devDial(t, d)
	payer := common.LeftPadBytes(crypto.PubkeyToAddress(d.Payer().PublicKey).Bytes(), 32)
	var slots []common.Hash
	for i := range 8 {
		slots = append(slots, common.BigToHash(big.NewInt(int64(i))))
		slots = append(slots, crypto.Keccak256Hash(payer, common.BigToHash(big.NewInt(int64(i))).Bytes()))
	}
	nonzero := 0
	for _, contract := range []common.Address{TokenAddress, contracts.Permit2Address} {
		for _, slot := range slots {
			got, err := d.StorageAt(ctx, contract, slot)
			want, rpcErr := client.StorageAt(ctx, contract, slot, nil)
			if err != nil || rpcErr != nil || !bytes.Equal(got, want) {
				t.Fatalf("slot %s of %s: StorageAt %x (%v), over HTTP %x (%v)", slot, contract, got, err, want, rpcErr)
			}
			if new(big.Int).SetBytes(got).Sign() != 0 {
				nonzero++
			}
		}
	}
	if nonzero == 0 {
		t.Fatal("every slot read was zero: the comparison proves nothing; read slots that are set")
	}
}
