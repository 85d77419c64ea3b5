package chain_test

import (
	"context"
	"testing"

	"github.com/ethereum/go-ethereum/accounts"
	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
)

// A sign-in's message signed by a contract wallet's owner is the wallet's: deployed (ERC-1271) or not yet, its
// signature wrapped in ERC-6492 naming the trusted factory; another key's signature, or a wallet of a factory
// not trusted, is not.
func TestAContractWalletsMessageSignatureIsCheckedAsItsPaymentsAre(t *testing.T) {
	w := newWalletFixture(t)
	digest := [32]byte(accounts.TextHash([]byte("example.com wants you to sign in with your Ethereum account")))
	signed := func(sw *smartWallet, signer *chaintest.Account) []byte {
		t.Helper()
		sig, err := chain.SignDigest(signer.Key, digest)
		if err != nil {
			t.Fatal(err)
		}
		raw := sig[:]
		if !w.c.HasCode(sw.addr) {
			data, err := contracts.PackCreateAccount(sw.account)
			if err != nil {
				t.Fatal(err)
			}
			if raw, err = contracts.WrapERC6492(sw.factory, data, raw); err != nil {
				t.Fatal(err)
			}
		}
		return raw
	}
	deployed, undeployed := w.newWallet("siwx deployed", true, w.factory), w.newWallet("siwx undeployed", false, w.factory)
	foreign := w.newWallet("siwx foreign", false, w.stranger)
	stranger := chaintest.DeriveAccount("siwx stranger", 0)
	for _, c := range []struct {
		name   string
		wallet *smartWallet
		signer *chaintest.Account
		want   bool
	}{
		{"deployed, its owner", deployed, deployed.owner, true},
		{"undeployed, its owner", undeployed, undeployed.owner, true},
		{"deployed, another key", deployed, stranger, false},
		{"undeployed, another key", undeployed, stranger, false},
		{"an untrusted factory's", foreign, foreign.owner, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := w.f.CheckMessageSignature(context.Background(), w.net, c.wallet.addr, digest, signed(c.wallet, c.signer))
			if err != nil || got != c.want {
				t.Fatalf("CheckMessageSignature = %v, %v; want %v", got, err, c.want)
			}
		})
	}
	if got, _ := w.f.CheckMessageSignature(context.Background(), w.net, common.HexToAddress("0x01"), digest, make([]byte, 65)); got {
		t.Error("an address without code accepted a signature")
	}
	if w.c.HasCode(undeployed.addr) {
		t.Error("checking a sign-in deployed the wallet: nothing may be sent")
	}
}
