package kafkabroker_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The README's block, what a team copies, builds as it is printed: in a
// module of a team's own outside the repository that requires the outbox
// modules (replaced by this repository's folders), inside a function that
// gives it the names it uses (an outbox, a handler, a context).
func TestReadmeBlockBuilds(t *testing.T) {
	page, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, block, _ := strings.Cut(string(page), "<!-- block: builds -->\n```go\n")
	block, _, ok := strings.Cut(block, "```")
	for _, want := range []string{"kafkabroker.NewPublisher(cl,", "kafkabroker.NewConsumer(warehouse,", "consumer.Run(ctx)"} {
		if !ok || !strings.Contains(block, want) {
			t.Fatalf("README.md's block lacks %s:\n%s", want, block)
		}
	}
	repo, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	src := `package readme

import (
	"context"

	"github.com/twmb/franz-go/pkg/kgo"

	"example.com/patterns/enterprise/outbox/kafkabroker"
	"example.com/patterns/enterprise/outbox/postgres"
)

func readme(ctx context.Context, ob *postgres.Outbox[postgres.SQLTx], warehouse kafkabroker.Handler) error {
` + block + `}
`
	mod := "module example.org/team\n\ngo 1.26.0\n\n" +
		"require (\n\texample.com/patterns/enterprise/outbox/kafkabroker v0.0.0\n\texample.com/patterns/enterprise/outbox/postgres v0.0.0\n)\n\n" +
		"replace (\n\texample.com/patterns/enterprise/outbox/kafkabroker => " + filepath.Join(repo, "kafkabroker") +
		"\n\texample.com/patterns/enterprise/outbox/postgres => " + filepath.Join(repo, "postgres") + "\n)\n"
	var sum []byte
	for _, f := range []string{"go.sum", "../postgres/go.sum"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		sum = append(sum, b...)
	}
	dir := t.TempDir()
	for name, data := range map[string][]byte{"go.mod": []byte(mod), "go.sum": sum, "readme.go": []byte(src)} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, args := range [][]string{{"mod", "tidy"}, {"build", "./..."}} {
		cmd := exec.Command("go", args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GOWORK=off")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go %s: %v\n%s\n%s", strings.Join(args, " "), err, out, src)
		}
	}
}
