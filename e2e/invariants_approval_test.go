package e2e

import (
	"bytes"

	"fmt"
	"math/big"
	"sort"
	"strings"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/payer"
)

// The sponsored-approval lane of the money-invariant run: the route /approve/ declares erc20ApprovalGasSponsoring
// (gas_sponsoring erc20_approval; the gateways' network takes approval_sponsoring) and is paid by payers that
// hold tokens and nothing else: no Permit2 allowance, no gas. A payer's first payments there carry its own signed
// approve(Permit2) transaction, whose gas the gateway's engine funds before it sends the approval and then the
// settlement; once an approval mined, its payments are plain permit2 ones. Concurrent first payments of one payer
// (each with an approval of the same nonce), presentations at other gateways and routes, kills, reloads and RPC
// faults cross it as every action of the run does. The check judges what the engines gave away in gas money.

// invSponsoredPayers is how many payers the lane has; invSponsoredTokens what each holds of the token.
const (
	invSponsoredPayers = 8
	invSponsoredTokens = 1_000_000
)

// fundSponsoredPayers makes the lane's payers: fresh keys, each given tokens by demo payer 0 (before the run's
// balances are read), no gas and no allowance.
func (w *invWorld) fundSponsoredPayers() {
	for i := range invSponsoredPayers {
		key, err := crypto.GenerateKey()
		if err != nil {
			w.t.Fatal(err)
		}
		p, err := payer.New(key, payer.Options{RPC: w.facts.RPC, MaxValidity: invValidity})
		if err != nil {
			w.t.Fatal(err)
		}
		w.t.Cleanup(func() { p.Close() })
		w.dev.send(devchain.PayerKey(), devchain.TokenAddress, nil, callToken(w.t, "transfer", p.Address(), big.NewInt(invSponsoredTokens)))
		w.sponsored = append(w.sponsored, &invPayer{n: 100 + i, addr: p.Address(), p: p})
	}
}

// allPayers are the payers whose balances the checks judge: the workers', the payer.Transport's and the lane's.
func (w *invWorld) allPayers() []*invPayer {
	return append(append([]*invPayer(nil), w.payers...), w.sponsored...)
}

// approveSelector is the first four bytes of approve(address,uint256)'s calldata.
var approveSelector = crypto.Keccak256([]byte("approve(address,uint256)"))[:4]

// checkApprovalSponsored judges approval-sponsored-once: no settlement wallet sent a lane payer gas money more
// than once, nor gas money for an approval that never mined; a lane payer's approval mined at most once; and the
// lane ran (some approval mined).
func (r *invRun) checkApprovalSponsored(end *invEnd) ([]invViolation, string) {
	ours := map[common.Address]bool{}
	for _, a := range r.w.wallets() {
		ours[a] = true
	}
	lane := map[common.Address]*invPayer{}
	for _, pp := range r.w.sponsored {
		lane[pp.addr] = pp
	}
	fundings := map[common.Address]int{}
	funded := map[common.Address]*big.Int{}
	approvals := map[common.Address]int{}
	seen := map[common.Address][]string{} // each funding and approval of a payer, for a violation's message
	var failedApprovals []string
	signer := types.LatestSignerForChainID(new(big.Int).SetUint64(devchain.DefaultChainID))
	head := r.w.dev.head()
	for n := r.w.startBlock + 1; n <= head; n++ {
		ctx, cancel := rpcContext()
		blk, err := r.w.dev.client.BlockByNumber(ctx, new(big.Int).SetUint64(n))
		if err != nil {
			cancel()
			return []invViolation{{what: fmt.Sprintf("reading block %d: %v", n, err)}}, ""
		}
		for _, tx := range blk.Transactions() {
			from, err := types.Sender(signer, tx)
			if err != nil || tx.To() == nil {
				continue
			}
			switch {
			case ours[from] && lane[*tx.To()] != nil && tx.Value().Sign() > 0:
				fundings[*tx.To()]++
				if funded[*tx.To()] == nil {
					funded[*tx.To()] = new(big.Int)
				}
				funded[*tx.To()].Add(funded[*tx.To()], tx.Value())
				seen[*tx.To()] = append(seen[*tx.To()], fmt.Sprintf("block %d: %s wei from %s (tx %s)", n, tx.Value(), from.Hex()[:8], tx.Hash().Hex()[:12]))
			case lane[from] != nil && bytes.HasPrefix(tx.Data(), approveSelector):
				rc, err := r.w.dev.client.TransactionReceipt(ctx, tx.Hash())
				switch {
				case err != nil:
					failedApprovals = append(failedApprovals, fmt.Sprintf("%s: no receipt: %v", tx.Hash(), err))
				case rc.Status != types.ReceiptStatusSuccessful:
					failedApprovals = append(failedApprovals, fmt.Sprintf("%s of payer %d reverted in block %d", tx.Hash(), lane[from].n, n))
				default:
					approvals[from]++
					seen[from] = append(seen[from], fmt.Sprintf("block %d: approval nonce %d, fee cap %s, gas %d, used %d (tx %s)", n, tx.Nonce(), tx.GasFeeCap(), tx.Gas(), rc.GasUsed, tx.Hash().Hex()[:12]))
				}
			}
		}
		cancel()
	}
	var out []invViolation
	var parts []string
	mined := 0
	for _, pp := range r.w.sponsored {
		f, a := fundings[pp.addr], approvals[pp.addr]
		mined += a
		if f == 0 && a == 0 {
			continue
		}
		parts = append(parts, fmt.Sprintf("payer %d: funded %d× (%s wei), approved %d×", pp.n, f, orZero(funded[pp.addr]), a))
		switch {
		case f > 1:
			out = append(out, invViolation{what: fmt.Sprintf("payer %d was sent gas money %d times (%s wei in all) for %d approval(s) mined: the engines paid for an approval twice (%s)",
				pp.n, f, funded[pp.addr], a, strings.Join(seen[pp.addr], "; "))})
		case f > a:
			out = append(out, invViolation{what: fmt.Sprintf("payer %d was sent gas money (%s wei) and its approval never mined (%s)", pp.n, funded[pp.addr], strings.Join(seen[pp.addr], "; "))})
		}
		if a > 1 {
			out = append(out, invViolation{what: fmt.Sprintf("payer %d's approval of Permit2 mined %d times", pp.n, a)})
		}
	}
	for _, f := range failedApprovals {
		out = append(out, invViolation{what: "a sponsored approval " + f})
	}
	sort.Strings(parts)
	delivered := 0
	for _, p := range r.snapshot() {
		if p.route.gasSponsoring != "" && p.delivered() > 0 {
			delivered++
		}
	}
	tried := 0
	for _, p := range r.snapshot() {
		if p.route.gasSponsoring != "" {
			tried++
		}
	}
	switch {
	case mined == 0 && delivered > 0:
		out = append(out, invViolation{what: fmt.Sprintf("%d payments on the sponsored route delivered and no sponsored approval mined: the lane's payers have no allowance without one", delivered)})
	case mined == 0 && tried > 0:
		// The route's payments may all have been cut short or refused for reasons of their own (judged by the
		// checks above); the draws of a short scarce run can also leave the route without a payment at all.
		parts = append(parts, fmt.Sprintf("no approval mined for the route's %d payments, none delivered", tried))
	case mined == 0:
		parts = append(parts, "the run's draws paid nothing on the sponsored route")
	}
	return out, fmt.Sprintf("%d payments on the sponsored route delivered; %d approvals mined; %s", delivered, mined, strings.Join(parts, "; "))
}
