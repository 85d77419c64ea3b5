package caddymodule

import (
	"crypto/ecdsa"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/ethereum/go-ethereum/crypto"
	"github.com/spf13/cobra"

	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/payer"
)

// envPayerKey is the environment variable `caddy x402 pay` takes the payer key from when no flag gives one:
// unlike --key, it does not show in the process list.
const envPayerKey = "X402_PAYER_KEY"

func init() {
	caddycmd.RegisterCommand(caddycmd.Command{
		Name:  "x402",
		Usage: "pay|bench|keygen|decode|devchain|status",
		Short: "Pays for x402-protected URLs, makes payer keys, decodes payment headers, runs the dev chain, shows the status",
		Long: `
Tools for the x402 payment protocol, for trying out and debugging a gateway:

  caddy x402 pay <url>         pays for a URL that answers 402 Payment Required
  caddy x402 bench <url>       load-tests a paid URL and checks the seller was paid for each answer
  caddy x402 keygen            makes a new payer key
  caddy x402 decode <header>   pretty-prints a PAYMENT-* header value
  caddy x402 devchain          runs the dev chain on its own, for Caddy processes to share
  caddy x402 status            shows a running Caddy's networks, wallets, journal and refusals

See 'caddy x402 <command> --help' for each.
`,
		CobraFunc: addX402Commands,
	})
}

// addX402Commands adds the subcommands of `caddy x402` to cmd. Each writes to the command's own output
// streams rather than to the process's, which is what lets tests run them as a whole, flags included.
func addX402Commands(cmd *cobra.Command) {
	pay := &cobra.Command{
		Use:   "pay [--key HEX | --key-file FILE] [--rpc URL] [--method permit2|eip3009|erc2612] [--dev] [--max AMOUNT] [--max-validity 10m] [--scheme exact|upto|batch-settlement] [--refund] [--sign-only] <url>",
		Short: "Pays for a URL that answers 402 Payment Required",
		Long: `
Requests the URL; when it answers 402 Payment Required, reads the payment
requirements (the PAYMENT-REQUIRED header of x402 version 2, or the JSON body
of version 1), picks one, signs the payment and requests the URL again with it
(PAYMENT-SIGNATURE, or X-PAYMENT for version 1). Prints the final HTTP status,
the response body and the decoded PAYMENT-RESPONSE with the transaction hash.
Exits non-zero unless the final status is 2xx.

The payer key comes from --key (hex, 0x optional), else the first line of
--key-file, else --dev, else the environment variable X402_PAYER_KEY. Prefer
the file or the variable: a --key shows in the process list. The key is never
printed.

--rpc is a JSON-RPC URL of the chain the payment settles on. With it, the
payment is signed at chain time, and a permit2 payer that has not approved
Permit2 adds the eip2612GasSponsoring permit so the facilitator pays the gas
of that approval. erc2612 payments need it (they sign the token's nonce).

--method chooses the asset transfer method; by default the first payable
requirement is taken, permit2 before the others. A requirement that names no
method is the public SDKs' standard one and is paid by eip3009 (EIP-3009
transferWithAuthorization, as USDC takes it).

--dev pays as the dev chain's demo payer through its default RPC address
(` + "http://" + devchain.DefaultListen + `); --key, --key-file and --rpc still win over it.

--max is the most the payment may authorize (an upto payment's maximum, which
the server may charge in full): raw token units (10000), or a dollar amount
($0.01) read in the token's decimals from the chain (needs --rpc or --dev). A
402 asking more is not signed. Without --max, pay signs at most $0.10, which
needs --rpc or --dev to read the decimals; without them, give --max in raw
units.

--max-validity caps how long the signed payment stays valid, whatever
maxTimeoutSeconds the server asks (default 10m); a maxTimeoutSeconds that does
not fit a 64-bit clock is refused.

The Permit2 and x402 proxy contracts a permit2 payment is signed for are the
canonical ones; a 402 naming others in its extra is not signed.

--scheme restricts the payment to one scheme. By default a batch-settlement
offer is paid only when the payer holds its channel with a deposit left, or
when nothing else is offered: its first payment deposits more than one request's
price into the escrow (the offer's minDeposit, or ten requests' worth, at most
--max), and each later one is a voucher of the cumulative amount. pay prints
the channel, its cumulative amount and what is left. With --rpc (or --dev) the
channel is found again in the escrow on the next run.

--refund asks the URL's server for what is left in the payer's batch-settlement
channel (the server claims what its vouchers charge and returns the rest on
chain), and pays nothing.

--sign-only prints the payment header value it would send and sends nothing.
`,
		Args: cobra.ExactArgs(1),
		RunE: cmdX402Pay,
	}
	pay.Flags().String("key", "", "Payer private key, hex")
	pay.Flags().String("key-file", "", "File whose first line is the payer private key, hex")
	pay.Flags().String("rpc", "", "JSON-RPC URL of the chain the payment settles on")
	pay.Flags().String("method", "", "Asset transfer method: permit2, eip3009 or erc2612 (default: the first payable, permit2 first)")
	pay.Flags().Bool("dev", false, "Pay as the dev chain's demo payer through its default RPC address")
	pay.Flags().Bool("sign-only", false, "Print the payment header value and send nothing")
	pay.Flags().Duration("timeout", 2*time.Minute, "Give up after this long, settlement included")
	pay.Flags().String("max", "", "Most the payment may authorize: raw units (10000) or dollars ($0.01, needs --rpc); default "+defaultPayMax)
	pay.Flags().Bool("sign-in", false, "Answer the 402's sign-in-with-x challenge with the payer's wallet first: where a payment bought access before, be served without paying")
	pay.Flags().String("payment-id", "", "Name the payment with this id (16 to 128 letters, digits, '-', '_') where the server declares payment-identifier (default: a fresh id there)")
	pay.Flags().Duration("max-validity", payer.DefaultMaxValidity, "Longest a signed payment stays valid, whatever the server asks")
	pay.Flags().String("scheme", "", "Scheme to pay by: exact, upto or batch-settlement (default: exact and upto before a new batch-settlement channel)")
	pay.Flags().Bool("refund", false, "Ask for what is left in the payer's batch-settlement channel with the URL's server, and pay nothing")

	keygen := &cobra.Command{
		Use:   "keygen",
		Short: "Makes a new payer private key and prints it with its address",
		Long: `
Makes a new secp256k1 private key and prints it (hex) and its address. Anyone
who has the key can spend what the address holds: keep it secret, and fund the
address only with what you mean to pay.
`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runKeygen(cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}

	decode := &cobra.Command{
		Use:   "decode <header>",
		Short: "Pretty-prints a PAYMENT-REQUIRED, PAYMENT-SIGNATURE, PAYMENT-RESPONSE or X-PAYMENT value",
		Long: `
Decodes a Base64 x402 header value and prints its JSON indented. Which header
it is comes from the document's shape; a whole header line such as
"PAYMENT-SIGNATURE: eyJ..." decodes as the header it names. Give - to read the
value from standard input. Errors say which field is wrong and what was expected.
`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			value := args[0]
			if value == "-" {
				b, err := io.ReadAll(io.LimitReader(cmd.InOrStdin(), 1<<20))
				if err != nil {
					return fmt.Errorf("reading the header value from standard input: %w", err)
				}
				value = string(b)
			}
			return runDecode(value, cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}

	cmd.AddCommand(pay, newBenchCommand(), keygen, decode, newDevchainCommand(), newStatusCommand())
}

// cmdX402Pay resolves the flags of `caddy x402 pay` and runs it.
func cmdX402Pay(cmd *cobra.Command, args []string) error {
	fs := cmd.Flags()
	keyHex, _ := fs.GetString("key")
	keyFile, _ := fs.GetString("key-file")
	dev, _ := fs.GetBool("dev")
	key, err := loadPayerKey(keyHex, keyFile, os.Getenv(envPayerKey), dev)
	if err != nil {
		return err
	}
	o := payOptions{URL: args[0], Key: key}
	o.RPC, _ = fs.GetString("rpc")
	o.Method, _ = fs.GetString("method")
	o.SignOnly, _ = fs.GetBool("sign-only")
	o.Timeout, _ = fs.GetDuration("timeout")
	o.Max, _ = fs.GetString("max")
	o.MaxValidity, _ = fs.GetDuration("max-validity")
	o.Scheme, _ = fs.GetString("scheme")
	o.Refund, _ = fs.GetBool("refund")
	o.PaymentID, _ = fs.GetString("payment-id")
	o.SignIn, _ = fs.GetBool("sign-in")
	if dev && o.RPC == "" {
		o.RPC = "http://" + devchain.DefaultListen
	}
	return runPay(cmd.Context(), o, cmd.OutOrStdout(), cmd.ErrOrStderr())
}

// loadPayerKey picks the payer key from the first source given: --key, --key-file, --dev, the environment.
// Errors name the source and what is wrong with it, never the key.
func loadPayerKey(keyHex, keyFile, env string, dev bool) (*ecdsa.PrivateKey, error) {
	switch {
	case keyHex != "" && keyFile != "":
		return nil, errors.New("both --key and --key-file are given; give one")
	case keyHex != "":
		return parsePayerKey("--key", keyHex)
	case keyFile != "":
		data, err := os.ReadFile(keyFile)
		if err != nil {
			return nil, fmt.Errorf("reading --key-file: %w", err)
		}
		first, _, _ := strings.Cut(string(data), "\n")
		return parsePayerKey("the first line of --key-file "+keyFile, first)
	case dev:
		return devchain.PayerKey(), nil
	case env != "":
		return parsePayerKey("$"+envPayerKey, env)
	}
	return nil, fmt.Errorf("no payer key: give --key, --key-file, --dev or the environment variable %s", envPayerKey)
}

// parsePayerKey reads a hex private key, 0x optional. source says where it came from in errors, which
// describe the text without quoting any of it.
func parsePayerKey(source, s string) (*ecdsa.PrivateKey, error) {
	s = strings.TrimSpace(s)
	s = strings.TrimPrefix(strings.TrimPrefix(s, "0x"), "0X")
	if len(s) != 64 {
		return nil, fmt.Errorf("%s: expected a private key of 64 hex digits (0x optional), got %d characters", source, len(s))
	}
	for i := 0; i < len(s); i++ {
		if !isHexDigit(s[i]) {
			return nil, fmt.Errorf("%s: expected a private key of 64 hex digits (0x optional), character %d is not a hex digit", source, i+1)
		}
	}
	key, err := crypto.HexToECDSA(s)
	if err != nil {
		// The only failures left are a zero key or one beyond the curve order; the message names neither digit.
		return nil, fmt.Errorf("%s: not a valid secp256k1 private key: %w", source, err)
	}
	return key, nil
}

func isHexDigit(c byte) bool {
	return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')
}

// runKeygen prints a new private key and its address, one labelled line each, and a warning to keep the key
// secret on stderr, so that stdout holds only what a script reads.
func runKeygen(stdout, stderr io.Writer) error {
	key, err := crypto.GenerateKey()
	if err != nil {
		return fmt.Errorf("generating a key: %w", err)
	}
	if _, err := fmt.Fprintf(stdout, "private key: 0x%x\naddress:     %s\n", crypto.FromECDSA(key), crypto.PubkeyToAddress(key.PublicKey).Hex()); err != nil {
		return err
	}
	fmt.Fprintln(stderr, "Keep the private key secret: anyone who has it can spend what the address holds.")
	return nil
}
