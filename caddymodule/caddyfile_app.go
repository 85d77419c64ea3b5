package caddymodule

import (
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"

	"github.com/x402-gateway/caddy-x402/x402"
)

func init() {
	httpcaddyfile.RegisterGlobalOption("x402", parseGlobalX402)
}

// durationArg reads the one argument of option as a Caddy duration ("90s", "1m30s", or nanoseconds).
func durationArg(d *caddyfile.Dispenser, option string) (time.Duration, error) {
	var s string
	if !d.AllArgs(&s) {
		return 0, d.ArgErr()
	}
	dur, err := caddy.ParseDuration(s)
	if err != nil {
		return 0, d.Errf("%s '%s': %v", option, s, err)
	}
	return dur, nil
}

// parseGlobalX402 sets up the `x402` app from the global option of the same name:
//
//	x402 {
//		network <caip2> {
//			rpc <url> [<url>...]
//			rpc_timeout <duration>
//			deadline_skew <duration>
//			asset <address> [name <name>] [version <version>] [decimals <n>] [eip3009]
//			wallet_keys <hex>[,<hex>...] [<hex>...]
//			wallet_key_file <path>
//			receipt_timeout <duration>
//			receipt_poll <duration>
//			methods permit2|eip3009|erc2612 [...]
//			legacy_fees
//			max_in_flight_per_wallet <n>
//			wallet_wait <duration>
//			replace_after <duration>
//			funds_cache <duration>|off
//			min_amount <raw units>
//			pay_to <address> [...]
//			smart_wallet_factories <address> [...]
//			approval_sponsoring [max_gas <n>] [max_fee_per_gas <wei>]
//			batch {
//				receiver_authorizer_key <hex>|<placeholder>
//				claim_every <n>
//				claim_amount <raw units>
//				claim_after <duration>
//			}
//		}
//		journal <path>
//		dev_chain {
//			chain_id <id>
//			listen <host:port>
//			block_time <duration>
//			data_dir <path>
//			alloc <file>
//			rpc <url>
//			wallets <n>|<n>-<m> [...]
//			approval_sponsoring [max_gas <n>] [max_fee_per_gas <wei>]
//			batch { ... }
//		}
//	}
func parseGlobalX402(d *caddyfile.Dispenser, existing any) (any, error) {
	app := new(App)
	if existing != nil {
		return nil, d.Err("the x402 global option may appear only once")
	}
	d.Next() // option name
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	for d.NextBlock(0) {
		switch d.Val() {
		case "network":
			n, err := parseNetwork(d)
			if err != nil {
				return nil, err
			}
			for _, prev := range app.Networks {
				if prev.Network == n.Network {
					return nil, d.Errf("network %s is configured twice", n.Network)
				}
			}
			app.Networks = append(app.Networks, n)
		case "dev_chain":
			dc, err := parseDevChain(d)
			if err != nil {
				return nil, err
			}
			app.DevChain = dc
		case "journal":
			if !d.NextArg() {
				return nil, d.ArgErr()
			}
			app.Journal = d.Val()
			if d.NextArg() {
				return nil, d.ArgErr()
			}
		default:
			return nil, d.Errf("unrecognized x402 option '%s'; want network, dev_chain or journal", d.Val())
		}
	}
	return httpcaddyfile.App{Name: "x402", Value: caddyconfig.JSON(app, nil)}, nil
}

func parseNetwork(d *caddyfile.Dispenser) (*Network, error) {
	n := new(Network)
	if !d.NextArg() {
		return nil, d.Err("network needs its CAIP-2 identifier, e.g. network eip155:72344 { ... }")
	}
	n.Network = d.Val()
	if _, err := x402.ChainID(n.Network); err != nil {
		return nil, d.Errf("network %q: %v", n.Network, err)
	}
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch d.Val() {
		case "rpc":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return nil, d.Err("rpc needs at least one URL")
			}
			n.RPC = append(n.RPC, args...)
		case "asset":
			if !d.NextArg() {
				return nil, d.Err("asset needs the token's contract address")
			}
			if err := addressProblem("asset", d.Val()); err != nil {
				return nil, d.Err(err.Error())
			}
			a := &Asset{Address: d.Val()}
			for d.NextArg() {
				key := d.Val()
				if key == x402.TransferEIP3009 {
					a.EIP3009 = true
					continue
				}
				if !d.NextArg() {
					return nil, d.Errf("asset %s needs a value", key)
				}
				switch key {
				case "name":
					a.Name = d.Val()
				case "version":
					a.Version = d.Val()
				case "decimals":
					dec, err := strconv.ParseUint(d.Val(), 10, 8)
					if err != nil {
						return nil, d.Errf("asset decimals %q is not a number from 0 to 255", d.Val())
					}
					if dec == 0 {
						return nil, d.Err("asset decimals 0 is not supported; x402 prices need a token with decimals")
					}
					a.Decimals = uint8(dec)
				default:
					return nil, d.Errf("unrecognized asset property '%s'; want name, version, decimals or eip3009", key)
				}
			}
			n.Assets = append(n.Assets, a)
		case "wallet_keys":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return nil, d.Err("wallet_keys needs at least one key or placeholder such as {env.X402_WALLET_KEYS}")
			}
			for i, k := range args {
				// A placeholder is read when Caddy starts (Provision names it then); a key written out (or one a
				// {$VAR} put in as the Caddyfile was read) is checked here, for its line.
				if hasPlaceholder(k) {
					continue
				}
				if err := walletKeysProblem(walletKeysSource(k, i, len(args)), k); err != nil {
					return nil, d.Err(err.Error())
				}
			}
			n.WalletKeys = append(n.WalletKeys, args...)
		case "wallet_key_file":
			if !d.AllArgs(&n.WalletKeyFile) {
				return nil, d.ArgErr()
			}
		case "rpc_timeout":
			dur, err := durationArg(d, "rpc_timeout")
			if err != nil {
				return nil, err
			}
			if dur <= 0 {
				return nil, d.Errf("rpc_timeout: want a positive duration such as 5s, got '%s'", d.Val())
			}
			n.RPCTimeout = caddy.Duration(dur)
		case "deadline_skew":
			dur, err := durationArg(d, "deadline_skew")
			if err != nil {
				return nil, err
			}
			if dur <= 0 {
				return nil, d.Errf("deadline_skew: want a positive duration such as 60s, got '%s'", d.Val())
			}
			n.DeadlineSkew = caddy.Duration(dur)
		case "receipt_timeout", "receipt_poll", "wallet_wait", "replace_after":
			name := d.Val()
			dur, err := durationArg(d, name)
			if err != nil {
				return nil, err
			}
			switch name {
			case "receipt_timeout":
				n.ReceiptTimeout = caddy.Duration(dur)
			case "receipt_poll":
				n.ReceiptPoll = caddy.Duration(dur)
			case "replace_after":
				n.ReplaceAfter = caddy.Duration(dur)
			default:
				n.WalletWait = caddy.Duration(dur)
			}
		case "funds_cache":
			var v string
			if !d.AllArgs(&v) {
				return nil, d.ArgErr()
			}
			if v == "off" {
				n.FundsCache = -1
				break
			}
			dur, err := caddy.ParseDuration(v)
			if err != nil || dur <= 0 {
				return nil, d.Errf("funds_cache: want a positive duration or off, got '%s'", v)
			}
			n.FundsCache = caddy.Duration(dur)
		case "methods":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return nil, d.Err("methods needs one or more of permit2, eip3009 and erc2612")
			}
			for _, m := range args {
				if !x402.IsTransferMethod(m) {
					return nil, d.Errf("unknown method '%s'; want permit2, eip3009 or erc2612", m)
				}
				if slices.Contains(n.Methods, m) {
					return nil, d.Errf("method '%s' is listed twice", m)
				}
				n.Methods = append(n.Methods, m)
			}
		case "legacy_fees":
			if d.NextArg() {
				return nil, d.ArgErr()
			}
			n.LegacyFees = true
		case "max_in_flight_per_wallet":
			var s string
			if !d.AllArgs(&s) {
				return nil, d.ArgErr()
			}
			v, err := strconv.Atoi(s)
			if err != nil || v < 1 {
				return nil, d.Errf("max_in_flight_per_wallet %q is not a positive number", s)
			}
			n.MaxInFlightPerWallet = v
		case "smart_wallet_factories":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return nil, d.Err("smart_wallet_factories needs one or more ERC-6492 factory addresses")
			}
			for _, a := range args {
				if err := addressProblem("smart_wallet_factories:", a); err != nil {
					return nil, d.Err(err.Error())
				}
			}
			n.SmartWalletFactories = append(n.SmartWalletFactories, args...)
		case "approval_sponsoring":
			if n.ApprovalSponsoring != nil {
				return nil, d.Err("approval_sponsoring is configured twice on this network")
			}
			a, err := parseApprovalSponsoring(d)
			if err != nil {
				return nil, err
			}
			n.ApprovalSponsoring = a
		case "min_amount", "pay_to":
			if _, err := unmarshalTermOption(d, &n.MinAmount, &n.PayTo); err != nil {
				return nil, err
			}
		case "batch":
			if n.Batch != nil {
				return nil, d.Err("batch is configured twice on this network")
			}
			b, err := parseBatchSettlement(d)
			if err != nil {
				return nil, err
			}
			n.Batch = b
		default:
			return nil, d.Errf("unrecognized network option '%s'", d.Val())
		}
	}
	return n, nil
}

// parseBatchSettlement reads a network's batch block: the receiver authorizer's key and the claim policy. Each
// value is checked at its line; a placeholder is read when Caddy starts.
func parseBatchSettlement(d *caddyfile.Dispenser) (*BatchSettlement, error) {
	return parseBatchBlock(d, false)
}

// parseBatchBlock reads a batch block: a network's (with the receiver authorizer's key), or a gate's in front of
// a remote facilitator (remote: the claim policy only, the receiver authorizer being the facilitator's).
func parseBatchBlock(d *caddyfile.Dispenser, remote bool) (*BatchSettlement, error) {
	b := new(BatchSettlement)
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		name := d.Val()
		var v string
		if !d.AllArgs(&v) {
			return nil, d.ArgErr()
		}
		switch name {
		case "receiver_authorizer_key":
			if remote {
				return nil, d.Err("batch: receiver_authorizer_key is the facilitator's own in front of facilitator_url (named in its /supported); a gate's batch block takes claim_every, claim_amount and claim_after")
			}
			if !hasPlaceholder(v) {
				if err := receiverAuthorizerKeyProblem(v, v); err != nil {
					return nil, d.Err(err.Error())
				}
			}
			b.ReceiverAuthorizerKey = v
		case "claim_every":
			every, err := strconv.Atoi(v)
			if err != nil || every < 1 {
				return nil, d.Errf("batch: claim_every %q: want a positive number of vouchers", v)
			}
			b.ClaimEvery = every
		case "claim_amount":
			if _, err := claimAmountValue(v); err != nil {
				return nil, d.Err(err.Error())
			}
			b.ClaimAmount = v
		case "claim_after":
			dur, err := caddy.ParseDuration(v)
			if err != nil || dur <= 0 {
				return nil, d.Errf("batch: claim_after %q: want a positive duration such as 30s", v)
			}
			b.ClaimAfter = caddy.Duration(dur)
		default:
			return nil, d.Errf("unrecognized batch option '%s'; want receiver_authorizer_key, claim_every, claim_amount or claim_after", name)
		}
	}
	if b.ReceiverAuthorizerKey == "" && !remote {
		return nil, d.Err("batch needs receiver_authorizer_key: the key that signs the claims of the vouchers it accepts")
	}
	return b, nil
}

// parseApprovalSponsoring reads `approval_sponsoring [max_gas <n>] [max_fee_per_gas <wei>]`.
func parseApprovalSponsoring(d *caddyfile.Dispenser) (*ApprovalSponsoring, error) {
	a := &ApprovalSponsoring{}
	args := d.RemainingArgs()
	if len(args)%2 != 0 {
		return nil, d.Err("approval_sponsoring takes pairs: [max_gas <n>] [max_fee_per_gas <wei>]")
	}
	for i := 0; i < len(args); i += 2 {
		switch args[i] {
		case "max_gas":
			v, err := strconv.ParseUint(args[i+1], 10, 64)
			if err != nil || v < 21000 {
				return nil, d.Errf("approval_sponsoring max_gas %q is not a gas limit (a number of at least 21000)", args[i+1])
			}
			a.MaxGas = v
		case "max_fee_per_gas":
			a.MaxFeePerGas = args[i+1]
			if _, err := a.config(); err != nil {
				return nil, d.Err(err.Error())
			}
		default:
			return nil, d.Errf("approval_sponsoring: unrecognized option '%s'; want max_gas or max_fee_per_gas", args[i])
		}
	}
	return a, nil
}

func parseDevChain(d *caddyfile.Dispenser) (*DevChainConfig, error) {
	dc := new(DevChainConfig)
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		name := d.Val()
		if name == "batch" {
			if dc.Batch != nil {
				return nil, d.Err("batch is configured twice in dev_chain")
			}
			b, err := parseBatchSettlement(d)
			if err != nil {
				return nil, err
			}
			dc.Batch = b
			continue
		}
		if name == "approval_sponsoring" {
			if dc.ApprovalSponsoring != nil {
				return nil, d.Err("approval_sponsoring is configured twice in dev_chain")
			}
			a, err := parseApprovalSponsoring(d)
			if err != nil {
				return nil, err
			}
			dc.ApprovalSponsoring = a
			continue
		}
		if name == "wallets" {
			wallets, err := parseWalletNumbers(d)
			if err != nil {
				return nil, err
			}
			dc.Wallets = append(dc.Wallets, wallets...)
			continue
		}
		var v string
		if !d.AllArgs(&v) {
			return nil, d.ArgErr()
		}
		switch name {
		case "chain_id":
			id, err := strconv.ParseUint(v, 10, 64)
			if err != nil || id == 0 {
				return nil, d.Errf("chain_id %q is not a positive number", v)
			}
			dc.ChainID = id
		case "listen":
			dc.Listen = v
		case "block_time":
			dur, err := caddy.ParseDuration(v)
			if err != nil {
				return nil, d.Errf("block_time: %v", err)
			}
			dc.BlockTime = caddy.Duration(dur)
		case "data_dir":
			dc.DataDir = v
		case "alloc":
			dc.Alloc = v
		case "rpc":
			dc.RPC = v
		default:
			return nil, d.Errf("unrecognized dev_chain option '%s'; want chain_id, listen, block_time, data_dir, alloc, rpc, wallets or batch", name)
		}
	}
	return dc, nil
}

// parseWalletNumbers reads the arguments of dev_chain's wallets: wallet numbers and ranges such as 4-7.
func parseWalletNumbers(d *caddyfile.Dispenser) ([]int, error) {
	args := d.RemainingArgs()
	if len(args) == 0 {
		return nil, d.Err("wallets needs one or more wallet numbers or ranges, such as 0 1 or 4-7")
	}
	var wallets []int
	for _, arg := range args {
		first, last, isRange := strings.Cut(arg, "-")
		lo, err1 := strconv.ParseUint(first, 10, 16)
		hi, err2 := lo, error(nil)
		if isRange {
			hi, err2 = strconv.ParseUint(last, 10, 16)
		}
		if err1 != nil || err2 != nil || hi < lo {
			return nil, d.Errf("wallets: %q is not a wallet number or a range such as 4-7", arg)
		}
		for i := lo; i <= hi; i++ {
			wallets = append(wallets, int(i))
		}
	}
	return wallets, nil
}
