package devchain

import (
	"crypto/ecdsa"
	"strconv"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"
)

// The dev chain's accounts have well-known keys, as Hardhat's and Anvil's do, so that a second process (a load
// generator, a browser demo, a test) can use them without copying keys out of a log. Key number i of a role is
//
//	keccak256("caddy-x402 dev chain/" + role + "/" + decimal(i))
//
// with role "deployer", "wallet" or "payer", hashed again in the negligible case (about 2^-128) that the result
// is not a valid secp256k1 scalar. Everyone can compute these keys: they are for the dev chain only and must
// never hold anything of value on any other chain.

// keySeedPrefix starts every dev key's seed; changing it changes every documented address below.
const keySeedPrefix = "caddy-x402 dev chain/"

// Roles of the dev chain's deterministic accounts.
const (
	roleDeployer = "deployer"
	roleWallet   = "wallet"
	rolePayer    = "payer"
)

// Well-known addresses of the dev chain. A test holds them equal to what the keys derive.
var (
	// deployerAddress is the address of deployerKey, which deploys and owns the dev chain's StableCoin.
	deployerAddress = common.HexToAddress("0xbd2EF68429A7C66711cAa2e08cd195fEea267f20")
	// PayerAddress is the address of PayerKey, the dev chain's funded demo payer.
	PayerAddress = common.HexToAddress("0x850ec0D9fF24AeFeE83Dec34973B271e755B93B9")
	// TokenAddress is where the dev chain's StableCoin lives: crypto.CreateAddress(deployerAddress, 0),
	// the deployer's first transaction.
	TokenAddress = common.HexToAddress("0x69c1c4280cd64e46F1525c67AA9e5F784d09cB4C")
	// eip3009DeployerAddress is the address of eip3009DeployerKey (deployer number 1), which deploys and
	// owns the dev chain's USDCoin.
	eip3009DeployerAddress = common.HexToAddress("0x2Ef9ceb1f7d487317e6FA248aEAa146eD7829fe2")
	// EIP3009TokenAddress is where the dev chain's USDCoin (USDC-like: EIP-2612 and EIP-3009, domain
	// "USD Coin" / "2") lives: crypto.CreateAddress(eip3009DeployerAddress, 0).
	EIP3009TokenAddress = common.HexToAddress("0x0BD8CEB7EBD1e9e83d8552584eA50B8385fd8025")
)

// deployerKey returns the key that deploys the dev chain's StableCoin at TokenAddress and may mint it.
func deployerKey() *ecdsa.PrivateKey { return deriveKey(roleDeployer, 0) }

// eip3009DeployerKey returns the key that deploys the dev chain's USDCoin at EIP3009TokenAddress and may
// mint it.
func eip3009DeployerKey() *ecdsa.PrivateKey { return deriveKey(roleDeployer, 1) }

// walletKey returns settlement wallet number i of the dev chain.
func walletKey(i int) *ecdsa.PrivateKey { return deriveKey(roleWallet, i) }

// WalletKeys returns the first n settlement wallets of the dev chain.
func WalletKeys(n int) []*ecdsa.PrivateKey {
	keys := make([]*ecdsa.PrivateKey, 0, max(n, 0))
	for i := range max(n, 0) {
		keys = append(keys, walletKey(i))
	}
	return keys
}

// PayerKey returns the dev chain's demo payer, PayerKeyN(0).
func PayerKey() *ecdsa.PrivateKey { return PayerKeyN(0) }

// PayerKeyN returns demo payer number i of the dev chain.
func PayerKeyN(i int) *ecdsa.PrivateKey { return deriveKey(rolePayer, i) }

// deriveKey derives key i of role. Every call returns a fresh key, so callers cannot disturb each other.
func deriveKey(role string, i int) *ecdsa.PrivateKey {
	seed := crypto.Keccak256([]byte(keySeedPrefix + role + "/" + strconv.Itoa(i)))
	for {
		key, err := crypto.ToECDSA(seed)
		if err == nil {
			return key
		}
		seed = crypto.Keccak256(seed)
	}
}
