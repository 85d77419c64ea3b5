package chain_test

import (
	"context"
	"math/big"
	"testing"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// walletFixture is a facilitator that deploys undeployed wallets through one factory, on a chain with a second
// factory it does not trust.
type walletFixture struct {
	*usdcFixture
	factory, stranger common.Address
}

func newWalletFixture(t *testing.T) *walletFixture {
	t.Helper()
	w := &walletFixture{}
	w.usdcFixture = newUSDCFixture(t, 1_000_000, fixtureOpts{tune: func(fx *fixture, nc *chain.NetworkConfig) {
		w.factory, w.stranger = fx.c.DeploySmartWalletFactory(), fx.c.DeploySmartWalletFactory()
		nc.SmartWalletFactories = []common.Address{w.factory}
	}})
	return w
}

// smartWallet is a contract wallet of one owner key, deployed or not, holding both tokens.
type smartWallet struct {
	addr    common.Address
	owner   *chaintest.Account
	factory common.Address
	account contracts.SmartWalletAccount
}

// newWallet makes the wallet of a fresh owner key: deployed through the trusted factory, or (deploy false)
// only funded at its counterfactual address. It approves Permit2 for the StableCoin at creation.
func (w *walletFixture) newWallet(label string, deploy bool, factory common.Address) *smartWallet {
	w.t.Helper()
	sw := &smartWallet{owner: chaintest.DeriveAccount(label, 0), factory: factory}
	sw.account = contracts.SmartWalletAccount{Owner: sw.owner.Address, Token: w.c.Token, Spender: contracts.Permit2Address, Salt: big.NewInt(1)}
	if deploy {
		sw.addr = w.c.CreateSmartWallet(factory, sw.account)
	} else {
		sw.addr = w.c.SmartWalletAddress(factory, sw.account)
	}
	w.c.MintTo(w.c.Token, sw.addr, big.NewInt(1_000_000))
	w.c.MintTo(w.usdc, sw.addr, big.NewInt(1_000_000))
	if w.c.HasCode(sw.addr) != deploy {
		w.t.Fatalf("wallet %s deployed = %v, want %v", sw.addr.Hex(), !deploy, deploy)
	}
	return sw
}

// sign sets the payment's payer to the wallet and its signature to signer's signature of the payment's digest
// (the wallet's owner's, for a good one), wrapped in ERC-6492 when the wallet has no code yet.
func (w *walletFixture) sign(req *x402.VerifyRequest, sw *smartWallet, signer *chaintest.Account) {
	w.t.Helper()
	pl := &req.PaymentPayload.Payload
	var digest common.Hash
	if a := pl.Permit2Authorization; a != nil {
		a.From = sw.addr.Hex() // Permit2's digest does not sign the owner: the wallet vouches for it
		t, _, err := chain.Permit2TransferFromPayload(a)
		if err != nil {
			w.t.Fatal(err)
		}
		digest = chain.Permit2Digest(chain.Permit2DomainSeparator(w.c.ChainID, contracts.Permit2Address), t)
	} else {
		pl.Authorization.From = sw.addr.Hex()
		a, err := chain.TransferAuthorizationFromPayload(pl.Authorization)
		if err != nil {
			w.t.Fatal(err)
		}
		digest = chain.TransferAuthorizationDigest(chain.PermitDomainSeparator(contracts.USDCoinName, contracts.USDCoinVersion, w.c.ChainID, w.usdc), a)
	}
	sig, err := chain.SignDigest(signer.Key, digest)
	if err != nil {
		w.t.Fatal(err)
	}
	raw := sig[:]
	if !w.c.HasCode(sw.addr) {
		data, err := contracts.PackCreateAccount(sw.account)
		if err != nil {
			w.t.Fatal(err)
		}
		if raw, err = contracts.WrapERC6492(sw.factory, data, raw); err != nil {
			w.t.Fatal(err)
		}
	}
	pl.Signature = "0x" + common.Bytes2Hex(raw)
}

// payment is a payment of the wallet by method, signed by signer.
func (w *walletFixture) payment(method string, sw *smartWallet, signer *chaintest.Account) x402.VerifyRequest {
	w.t.Helper()
	var req x402.VerifyRequest
	if method == x402.TransferPermit2 {
		req = w.permit2(sw.owner, w.requirements(x402.TransferPermit2), chain.Permit2Options{})
	} else {
		req = w.eip3009(sw.owner, w.eip3009Requirements(), chain.EIP3009Options{})
	}
	w.sign(&req, sw, signer)
	return req
}

func (w *walletFixture) balance(method string, addr common.Address) *big.Int {
	if method == x402.TransferPermit2 {
		return w.c.BalanceOf(w.c.Token, addr)
	}
	return w.c.BalanceOf(w.usdc, addr)
}

// A deployed ERC-1271 wallet pays in one settlement transaction; an undeployed ERC-6492 wallet pays in two,
// its deployment through the trusted factory and the settlement, and is deployed afterwards; its next payment
// takes one. Each by permit2 and by eip3009, the balances moving by exactly the price.
func TestSmartWalletsPayByPermit2AndEIP3009DeployedOrNot(t *testing.T) {
	w := newWalletFixture(t)
	for _, method := range []string{x402.TransferPermit2, x402.TransferEIP3009} {
		for _, deployed := range []bool{true, false} {
			name := method + " from an undeployed ERC-6492 wallet"
			if deployed {
				name = method + " from a deployed ERC-1271 wallet"
			}
			t.Run(name, func(t *testing.T) {
				sw := w.newWallet("wallet "+name, deployed, w.factory)
				pay := func(wantTxs uint64) {
					t.Helper()
					req := w.payment(method, sw, sw.owner)
					before, sellerBefore, sent := w.balance(method, sw.addr), w.balance(method, w.payTo), sum(w.sentByWallets())
					if v := w.verify(req); !v.IsValid || v.Payer != sw.addr.Hex() {
						t.Fatalf("verify = %+v, want valid for the wallet %s", v, sw.addr.Hex())
					}
					s := w.settle(req)
					if !s.Success || s.Payer != sw.addr.Hex() {
						t.Fatalf("settle = %+v, want success for the wallet", s)
					}
					if d := new(big.Int).Sub(before, w.balance(method, sw.addr)); d.Int64() != price {
						t.Fatalf("the wallet's balance fell by %s, want %d", d, price)
					}
					if d := new(big.Int).Sub(w.balance(method, w.payTo), sellerBefore); d.Int64() != price {
						t.Fatalf("the seller's balance rose by %s, want %d", d, price)
					}
					if n := sum(w.sentByWallets()) - sent; n != wantTxs {
						t.Fatalf("the settlement wallets sent %d transactions, want %d", n, wantTxs)
					}
				}
				if deployed {
					pay(1)
					return
				}
				pay(2) // the deployment, then the settlement
				if !w.c.HasCode(sw.addr) {
					t.Fatal("the wallet has no code after its first payment")
				}
				pay(1)
			})
		}
	}
}

// A contract wallet's signature the wallet does not accept, deployed or not, and a wallet whose factory the
// facilitator does not trust are refused with their reason before anything is sent or journalled.
func TestBadSmartWalletPaymentsAreRefusedWithNothingSent(t *testing.T) {
	w := newWalletFixture(t)
	intruder := chaintest.DeriveAccount("not the owner", 0)
	deployed := w.newWallet("deployed wallet", true, w.factory)
	undeployed := w.newWallet("undeployed wallet", false, w.factory)
	foreign := w.newWallet("wallet of a stranger's factory", false, w.stranger)
	cases := []struct {
		name   string
		method string
		sw     *smartWallet
		signer *chaintest.Account
		reason string
	}{
		{"permit2 signed by another key for a deployed wallet", x402.TransferPermit2, deployed, intruder, x402.ReasonPermit2InvalidSignature},
		{"eip3009 signed by another key for a deployed wallet", x402.TransferEIP3009, deployed, intruder, x402.ReasonEIP3009InvalidSignature},
		{"permit2 signed by another key for an undeployed wallet", x402.TransferPermit2, undeployed, intruder, x402.ReasonPermit2InvalidSignature},
		{"eip3009 signed by another key for an undeployed wallet", x402.TransferEIP3009, undeployed, intruder, x402.ReasonEIP3009InvalidSignature},
		{"permit2 of a wallet from an untrusted factory", x402.TransferPermit2, foreign, foreign.owner, x402.ReasonEIP6492FactoryNotAllowed},
		{"eip3009 of a wallet from an untrusted factory", x402.TransferEIP3009, foreign, foreign.owner, x402.ReasonEIP6492FactoryNotAllowed},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			req := w.payment(tc.method, tc.sw, tc.signer)
			sent := sum(w.sentByWallets())
			if v := w.verify(req); v.IsValid || v.InvalidReason != tc.reason || v.InvalidMessage == "" {
				t.Fatalf("verify = %+v, want %s with a message", v, tc.reason)
			}
			if s := w.settle(req); s.Success || s.ErrorReason != tc.reason || s.Transaction != "" {
				t.Fatalf("settle = %+v, want %s and no transaction", s, tc.reason)
			}
			if n := sum(w.sentByWallets()) - sent; n != 0 {
				t.Fatalf("the settlement wallets sent %d transactions for a refused payment", n)
			}
			if w.c.HasCode(tc.sw.addr) != (tc.sw == deployed) {
				t.Fatalf("the refused payment changed whether %s is deployed", tc.sw.addr.Hex())
			}
			from, nonce := req.PaymentPayload.Payload.PayerAndNonce()
			if tc.method == x402.TransferEIP3009 {
				nonce = common.HexToHash(nonce).Hex()
			}
			id := journal.PaymentID(w.net, tc.method, req.PaymentRequirements.Asset, common.HexToAddress(from).Hex(), nonce)
			if _, ok, err := w.journal.Get(context.Background(), id); err != nil || ok {
				t.Fatalf("the journal holds a record of the refused payment (%v, %v)", ok, err)
			}
		})
	}
}
