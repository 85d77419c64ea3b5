package chain

import (
	"math/big"
	"sync"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
)

// EIP-712 type strings of the two transfer methods (x402-wire-facts 4.1 and 4.2). The type hashes derived
// from them are fixed by deployed contracts and clients, so tests pin them to the published values.
const (
	// permitDomainType is the domain of an EIP-2612 token: name and version from requirements.extra.
	permitDomainType = "EIP712Domain(string name,string version,uint256 chainId,address verifyingContract)"
	// permit2DomainType is Permit2's domain, which has no version.
	permit2DomainType = "EIP712Domain(string name,uint256 chainId,address verifyingContract)"
	// permitType is the EIP-2612 Permit message.
	permitType = "Permit(address owner,address spender,uint256 value,uint256 nonce,uint256 deadline)"
	// tokenPermissionsType is Permit2's token and amount pair.
	tokenPermissionsType = "TokenPermissions(address token,uint256 amount)"
	// witnessType is the x402 witness bound into a Permit2 signature.
	witnessType = "Witness(address to,uint256 validAfter)"
	// permitWitnessTransferFromType is the full Permit2 message type with the x402 witness, referenced types
	// appended in alphabetical order as EIP-712 requires.
	permitWitnessTransferFromType = "PermitWitnessTransferFrom(TokenPermissions permitted,address spender,uint256 nonce,uint256 deadline,Witness witness)" +
		tokenPermissionsType + witnessType
	// uptoWitnessType is the x402 upto witness: the exact one with the facilitator address that alone may
	// settle the payment.
	uptoWitnessType = "Witness(address to,address facilitator,uint256 validAfter)"
	// uptoPermitWitnessTransferFromType is the full Permit2 message type with the upto witness.
	uptoPermitWitnessTransferFromType = "PermitWitnessTransferFrom(TokenPermissions permitted,address spender,uint256 nonce,uint256 deadline,Witness witness)" +
		tokenPermissionsType + uptoWitnessType
	// permit2WitnessTypeString is the witnessTypeString the proxy hands to Permit2.permitWitnessTransferFrom.
	permit2WitnessTypeString = "Witness witness)" + tokenPermissionsType + witnessType
	// transferWithAuthorizationType is the EIP-3009 message of an eip3009 payment, signed under the token's
	// domain (the same domain type as an EIP-2612 permit's).
	transferWithAuthorizationType = "TransferWithAuthorization(address from,address to,uint256 value,uint256 validAfter,uint256 validBefore,bytes32 nonce)"
	// permit2DomainName is the name in Permit2's EIP-712 domain.
	permit2DomainName = "Permit2"
)

// Canonical deployments of the permit2 transfer method (x402-wire-facts 4.2), named once in package contracts.
var (
	canonicalPermit2 = contracts.Permit2Address
	canonicalProxy   = contracts.ProxyAddress
	// canonicalUptoProxy is the spender of upto payments.
	canonicalUptoProxy = contracts.UptoProxyAddress
)

// Type hashes, computed once: they never change, and hashing them per request would double the hot path's
// keccak work.
var (
	permitDomainTypeHash              = crypto.Keccak256Hash([]byte(permitDomainType))
	permit2DomainTypeHash             = crypto.Keccak256Hash([]byte(permit2DomainType))
	permitTypeHash                    = crypto.Keccak256Hash([]byte(permitType))
	tokenPermissionsTypeHash          = crypto.Keccak256Hash([]byte(tokenPermissionsType))
	witnessTypeHash                   = crypto.Keccak256Hash([]byte(witnessType))
	permitWitnessTransferFromTypeHash = crypto.Keccak256Hash([]byte(permitWitnessTransferFromType))
	uptoWitnessTypeHash               = crypto.Keccak256Hash([]byte(uptoWitnessType))
	uptoPermitWitnessTransferFromHash = crypto.Keccak256Hash([]byte(uptoPermitWitnessTransferFromType))
	permit2NameHash                   = crypto.Keccak256Hash([]byte(permit2DomainName))
	transferWithAuthorizationTypeHash = crypto.Keccak256Hash([]byte(transferWithAuthorizationType))
)

// Permit is an EIP-2612 Permit message. Numbers must lie in [0, 2^256); nil counts as zero.
type Permit struct {
	Owner    common.Address
	Spender  common.Address
	Value    *big.Int
	Nonce    *big.Int
	Deadline *big.Int
}

// permit2Transfer is a Permit2 PermitWitnessTransferFrom with the x402 witness: Permit2 lets Spender (the
// x402 proxy) move Amount of Token once, to To only, not before ValidAfter and not after Deadline. An upto
// payment's witness names Facilitator too, the only sender the upto proxy takes its settlement from, and
// Amount is then the most it moves (permit2Digest signs no Facilitator, uptoDigest does).
// Numbers must lie in [0, 2^256); nil counts as zero.
type permit2Transfer struct {
	Token       common.Address
	Amount      *big.Int
	Spender     common.Address
	Nonce       *big.Int
	Deadline    *big.Int
	To          common.Address
	Facilitator common.Address
	ValidAfter  *big.Int
}

// transferAuthorization is an EIP-3009 TransferWithAuthorization message: the token moves Value from From to
// To once, when sent after ValidAfter and before ValidBefore, under the random 32-byte Nonce. Numbers must lie
// in [0, 2^256); nil counts as zero.
type transferAuthorization struct {
	From        common.Address
	To          common.Address
	Value       *big.Int
	ValidAfter  *big.Int
	ValidBefore *big.Int
	Nonce       common.Hash
}

// hasher is a keccak state with a scratch buffer big enough for the largest struct encoding here (seven words).
// Both live in a pool so that hashing on the hot path neither allocates nor escapes buffers to the heap.
type hasher struct {
	st  crypto.KeccakState
	buf [7 * 32]byte
	out common.Hash
}

var hasherPool = sync.Pool{New: func() any { return &hasher{st: crypto.NewKeccakState()} }}

// sum returns keccak256 of the first n bytes of the scratch buffer.
func (h *hasher) sum(n int) common.Hash {
	h.st.Reset()
	h.st.Write(h.buf[:n])
	h.st.Read(h.out[:])
	return h.out
}

// word returns the i-th 32-byte word of the scratch buffer.
func (h *hasher) word(i int) []byte { return h.buf[i*32 : i*32+32] }

// digest returns keccak256("\x19\x01" || domain || structHash), the EIP-712 signing digest.
func (h *hasher) digest(domain, structHash common.Hash) common.Hash {
	h.buf[0], h.buf[1] = 0x19, 0x01
	copy(h.buf[2:34], domain[:])
	copy(h.buf[34:66], structHash[:])
	return h.sum(66)
}

func putHash(dst []byte, x common.Hash) { copy(dst[:32], x[:]) }

func putAddress(dst []byte, a common.Address) {
	clear(dst[:12])
	copy(dst[12:32], a[:])
}

// putUint256 writes x as a 32-byte big-endian word. Values outside uint256 are reduced modulo 2^256 (two's
// complement for negatives), which is what the EVM would see; strict parsers keep such values off the
// verifier's path, so this only spares library callers a panic.
func putUint256(dst []byte, x *big.Int) {
	dst = dst[:32]
	switch {
	case x == nil:
		clear(dst)
	case x.Sign() >= 0 && x.BitLen() <= 256:
		x.FillBytes(dst)
	default:
		mask := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
		new(big.Int).And(x, mask).FillBytes(dst)
	}
}

// PermitDomainSeparator returns the EIP-712 domain separator of an EIP-2612 token. Prefer a domainCache on
// hot paths: this hashes three times.
func PermitDomainSeparator(name, version string, chainID *big.Int, token common.Address) common.Hash {
	h := hasherPool.Get().(*hasher)
	defer hasherPool.Put(h)
	putHash(h.word(0), permitDomainTypeHash)
	putHash(h.word(1), crypto.Keccak256Hash([]byte(name)))
	putHash(h.word(2), crypto.Keccak256Hash([]byte(version)))
	putUint256(h.word(3), chainID)
	putAddress(h.word(4), token)
	return h.sum(5 * 32)
}

// permit2DomainSeparator returns the EIP-712 domain separator of the Permit2 contract at permit2.
func permit2DomainSeparator(chainID *big.Int, permit2 common.Address) common.Hash {
	h := hasherPool.Get().(*hasher)
	defer hasherPool.Put(h)
	putHash(h.word(0), permit2DomainTypeHash)
	putHash(h.word(1), permit2NameHash)
	putUint256(h.word(2), chainID)
	putAddress(h.word(3), permit2)
	return h.sum(4 * 32)
}

// PermitDigest returns the EIP-712 digest an EIP-2612 permit signature signs, given the token's domain
// separator.
func PermitDigest(domain common.Hash, p Permit) common.Hash {
	h := hasherPool.Get().(*hasher)
	defer hasherPool.Put(h)
	putHash(h.word(0), permitTypeHash)
	putAddress(h.word(1), p.Owner)
	putAddress(h.word(2), p.Spender)
	putUint256(h.word(3), p.Value)
	putUint256(h.word(4), p.Nonce)
	putUint256(h.word(5), p.Deadline)
	return h.digest(domain, h.sum(6*32))
}

// transferAuthorizationDigest returns the EIP-712 digest an EIP-3009 TransferWithAuthorization signature signs,
// given the token's domain separator.
func transferAuthorizationDigest(domain common.Hash, a transferAuthorization) common.Hash {
	return erc3009Digest(domain, transferWithAuthorizationTypeHash, a)
}

// erc3009Digest returns the EIP-712 digest of an EIP-3009 authorization whose type (TransferWithAuthorization
// or ReceiveWithAuthorization: the same fields) hashes to typeHash, given the token's domain separator.
func erc3009Digest(domain, typeHash common.Hash, a transferAuthorization) common.Hash {
	h := hasherPool.Get().(*hasher)
	defer hasherPool.Put(h)
	putHash(h.word(0), typeHash)
	putAddress(h.word(1), a.From)
	putAddress(h.word(2), a.To)
	putUint256(h.word(3), a.Value)
	putUint256(h.word(4), a.ValidAfter)
	putUint256(h.word(5), a.ValidBefore)
	putHash(h.word(6), a.Nonce)
	return h.digest(domain, h.sum(7*32))
}

// permit2Digest returns the EIP-712 digest a Permit2 PermitWitnessTransferFrom signature with the x402
// witness signs, given Permit2's domain separator.
func permit2Digest(domain common.Hash, p permit2Transfer) common.Hash {
	h := hasherPool.Get().(*hasher)
	defer hasherPool.Put(h)

	putHash(h.word(0), witnessTypeHash)
	putAddress(h.word(1), p.To)
	putUint256(h.word(2), p.ValidAfter)
	return h.permitWitnessDigest(domain, permitWitnessTransferFromTypeHash, p, h.sum(3*32))
}

// uptoDigest returns the EIP-712 digest a Permit2 PermitWitnessTransferFrom signature with the x402 upto
// witness (to, facilitator, validAfter) signs, given Permit2's domain separator.
func uptoDigest(domain common.Hash, p permit2Transfer) common.Hash {
	h := hasherPool.Get().(*hasher)
	defer hasherPool.Put(h)

	putHash(h.word(0), uptoWitnessTypeHash)
	putAddress(h.word(1), p.To)
	putAddress(h.word(2), p.Facilitator)
	putUint256(h.word(3), p.ValidAfter)
	return h.permitWitnessDigest(domain, uptoPermitWitnessTransferFromHash, p, h.sum(4*32))
}

// permitWitnessDigest finishes the digest of p as a PermitWitnessTransferFrom whose type hash (which names the
// witness type) is typeHash and whose witness hashes to witness.
func (h *hasher) permitWitnessDigest(domain, typeHash common.Hash, p permit2Transfer, witness common.Hash) common.Hash {
	putHash(h.word(0), tokenPermissionsTypeHash)
	putAddress(h.word(1), p.Token)
	putUint256(h.word(2), p.Amount)
	permitted := h.sum(3 * 32)

	putHash(h.word(0), typeHash)
	putHash(h.word(1), permitted)
	putAddress(h.word(2), p.Spender)
	putUint256(h.word(3), p.Nonce)
	putUint256(h.word(4), p.Deadline)
	putHash(h.word(5), witness)
	return h.digest(domain, h.sum(6*32))
}

// domainCacheLimit bounds a domainCache: requirements can come from remote /verify callers, so the set of
// domains seen is not ours to bound, while the domains in real use are a handful per configured asset.
const domainCacheLimit = 256

// domainKey identifies a domain separator. The chain ID is kept as its 32-byte word so the key is comparable.
type domainKey struct {
	permit2  bool
	name     string
	version  string
	chainID  [32]byte
	contract common.Address
}

// domainCache remembers domain separators so that a verification hashes only its message. It is safe for
// concurrent use and its zero value is ready to use. It holds a bounded number of domains and starts over
// when full, so untrusted requirements cannot grow it without limit.
type domainCache struct {
	mu sync.RWMutex
	m  map[domainKey]common.Hash
}

// Permit returns the domain separator of an EIP-2612 token, as PermitDomainSeparator.
func (c *domainCache) Permit(name, version string, chainID *big.Int, token common.Address) common.Hash {
	k := domainKey{name: name, version: version, contract: token}
	putUint256(k.chainID[:], chainID)
	if d, ok := c.lookup(k); ok {
		return d
	}
	d := PermitDomainSeparator(name, version, chainID, token)
	c.store(k, d)
	return d
}

// Permit2 returns the domain separator of the Permit2 contract at permit2, as permit2DomainSeparator.
func (c *domainCache) Permit2(chainID *big.Int, permit2 common.Address) common.Hash {
	k := domainKey{permit2: true, contract: permit2}
	putUint256(k.chainID[:], chainID)
	if d, ok := c.lookup(k); ok {
		return d
	}
	d := permit2DomainSeparator(chainID, permit2)
	c.store(k, d)
	return d
}

// Len reports how many domain separators the cache holds.
func (c *domainCache) Len() int {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return len(c.m)
}

func (c *domainCache) lookup(k domainKey) (common.Hash, bool) {
	c.mu.RLock()
	d, ok := c.m[k]
	c.mu.RUnlock()
	return d, ok
}

func (c *domainCache) store(k domainKey, d common.Hash) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil || len(c.m) >= domainCacheLimit {
		c.m = make(map[domainKey]common.Hash, 8)
	}
	c.m[k] = d
}
